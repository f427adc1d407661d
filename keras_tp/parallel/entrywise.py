"""Whether an optimizer, or a variable's constraint, acts on each entry of
a variable on its own.

Where each rank updates its own pieces of a variable (tensor-parallel
shards, ZeRO partitions), an optimizer whose update of an entry reads
other entries of the variable (LAMB's trust ratio of norms, Adafactor's
row and column means, Muon's orthogonalised matrix), or a constraint that
reads across the cut (`MaxNorm` over the axis the variable is split on),
would compute it from a piece: each piece would take another update than
one device's.
"""

import copy

import keras
import numpy as np

# Options the `CoordinatedOptimizer` runs over the pieces itself (norms
# over every piece), and those that act on each entry alone.
_OPTIONS_OFF = {
    "clipnorm": None,
    "global_clipnorm": None,
    "use_ema": False,
    "gradient_accumulation_steps": None,
}
# A 4 x 6 variable and its four 2 x 3 blocks, cut along both axes.
_SHAPE = (4, 6)
_BLOCKS = [
    (slice(rows, rows + 2), slice(columns, columns + 3))
    for rows in (0, 2)
    for columns in (0, 3)
]


def reads_across_entries(optimizer):
    """Whether `optimizer` updates an entry of a variable from other
    entries of it.

    Measured rather than looked up by class, so it holds for optimizers
    of one's own: two steps of a fresh copy (its norm clips, weight
    averages and accumulation off) on a 4 x 6 variable, against two steps
    of another copy on the variable's four 2 x 3 blocks as variables of
    their own. A wrapper (`LossScaleOptimizer`) is judged by the
    optimizer it wraps.

    Args:
        optimizer: a Keras optimizer.

    Returns:
        A bool.

    Example:

    ```python
    reads_across_entries(keras.optimizers.AdamW())  # False
    reads_across_entries(keras.optimizers.Lamb())  # True: norms
    ```
    """
    # A wrapper (`LossScaleOptimizer`) updates as the optimizer it wraps.
    while hasattr(optimizer, "inner_optimizer"):
        optimizer = optimizer.inner_optimizer
    config = {**optimizer.get_config(), **_OPTIONS_OFF}
    rng = np.random.default_rng(0)
    value, *gradients = rng.normal(size=(3, *_SHAPE)).astype("float32")
    (whole,) = _stepped(optimizer, config, [value], [[g] for g in gradients])
    blocks = _stepped(
        optimizer,
        config,
        [value[block] for block in _BLOCKS],
        [[g[block] for block in _BLOCKS] for g in gradients],
    )
    assembled = np.empty_like(whole)
    for block, piece in zip(_BLOCKS, blocks):
        assembled[block] = piece
    return not np.allclose(whole, assembled, rtol=1e-5, atol=1e-7)


def _stepped(optimizer, config, values, gradients):
    """`values` after a fresh copy of `optimizer` applies each of
    `gradients` (one list per step) to them."""
    # A copy: `from_config` may change the config it is given.
    fresh = type(optimizer).from_config(copy.deepcopy(config))
    variables = [keras.Variable(v, name="probe") for v in values]
    for step in gradients:
        fresh.apply([keras.ops.convert_to_tensor(g) for g in step], variables)
    return [keras.ops.convert_to_numpy(v.value) for v in variables]


def constraint_reads_across(constraint, ndim, axis):
    """Whether a variable's `constraint` (`kernel_constraint=...`) reads
    entries across `axis`: its result on a variable of `ndim` dimensions
    cut in two along `axis` is not the two halves of its result on the
    whole (measured on a 4 x ... x 4 tensor).

    Args:
        constraint: a Keras constraint, or any callable of a tensor.
        ndim: the variable's number of dimensions.
        axis: the axis the variable is cut along.

    Returns:
        A bool.
    """
    rng = np.random.default_rng(0)
    value = rng.normal(size=(4,) * ndim).astype("float32")

    def constrained(part):
        result = constraint(keras.ops.convert_to_tensor(part))
        return keras.ops.convert_to_numpy(result)

    halves = [constrained(half) for half in np.split(value, 2, axis)]
    together = np.concatenate(halves, axis)
    return not np.allclose(constrained(value), together, rtol=1e-5, atol=1e-7)
