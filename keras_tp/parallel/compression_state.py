"""The state gradient compression keeps, and the warm-up before it starts.

PowerSGD and signs keep optimizer variables (each rank's error, PowerSGD's
`Q`s), placed here so that checkpoints keep them. Both start after a
warm-up of uncompressed updates (`WarmUpCodec`), as torch's PowerSGD hook
(`start_powerSGD_iter`) and DeepSpeed's 1-bit Adam (`freeze_step`) do:
early gradients change fast, and an error fed back from them, or Adam's
moments estimated from compressed gradients, keep the run behind.
"""

import numpy as np
from keras import ops

from keras_tp.keras_internals import bind_values
from keras_tp.parallel.buckets import PLAIN


class WarmUpCodec:
    """A compressing codec that sends uncompressed for the first updates.

    Updates number 1 to `warmup_steps` all-reduce their buckets as they
    are (`buckets.PLAIN`); later ones run `codec`. The switch is a traced
    conditional on the optimizer's `iterations`, so JAX and TensorFlow
    compile one step for both phases and torch takes one branch eagerly.
    The codec's errors and `Q`s are not touched during the warm-up: they
    start from zero and from their seeded value at the switch.

    `communication_stats()` counts the branch the last step ran: a flag
    variable (`compressing`), set by every step, tells the ledger which.

    Args:
        codec: the compressing codec (`PowerSGDCodec`, `SignCodec`).
        warmup_steps: uncompressed updates before compression starts.
        optimizer: the `CoordinatedOptimizer` that runs the codec.
    """

    scatters = False

    def __init__(self, codec, warmup_steps, optimizer):
        self.codec = codec
        self.warmup_steps = warmup_steps
        self.optimizer = optimizer
        self.compressing = optimizer.add_variable(
            (), initializer="zeros", dtype="int32", name="compressing"
        )

    @property
    def variables(self):
        return self.codec.variables

    def compressed_last(self):
        """Whether the last step sent compressed buckets."""
        return bool(ops.convert_to_numpy(self.compressing))

    def all_reduce(self, bucket, values, adapter):
        compressing = ops.greater_equal(
            self.optimizer.iterations, self.warmup_steps
        )
        self.compressing.assign(ops.cast(compressing, "int32"))
        stats = adapter.stats

        def compressed():
            with stats.conditional(self.compressed_last):
                return self.codec.all_reduce(bucket, values, adapter)

        def plain():
            with stats.conditional(lambda: not self.compressed_last()):
                return PLAIN.all_reduce(bucket, values, adapter)

        return _cond_with_state(
            compressing, compressed, plain, self.codec.state_of(bucket)
        )


def _cond_with_state(pred, true_fn, false_fn, state):
    """`ops.cond` of functions that return tensors and assign `state`.

    As `keras_internals.stateful_cond`, the branches run on the state's
    current values bound in a scope, since traced conditionals cannot let
    assignments escape; the new values are assigned after.

    Returns:
        The list the branch taken returns.
    """
    current = [v.value for v in state]

    def branch(fn):
        def run():
            with bind_values(zip(state, current)) as scope:
                out = list(fn())
                return out, [scope.get_current_value(v) for v in state]

        return run

    out, new = ops.cond(pred, branch(true_fn), branch(false_fn))
    for variable, value in zip(state, new):
        variable.assign(value)
    return list(out)


def per_rank_variable(optimizer, placement, reference, name):
    """A zero variable holding each rank's own copy of a gradient.

    Errors differ from rank to rank along `data` as the local gradients
    do, so the variable has a leading axis of one row per data rank,
    partitioned over `data` (each rank stores its row), and is split over
    `model` like `reference`. Its full value exists once, at build time.

    Args:
        optimizer: the `CoordinatedOptimizer` the variable belongs to.
        placement: the `Placement` that places it.
        reference: the trainable variable whose gradient it follows.
        name: suffix of the variable's name.
    """
    full_shape = placement.full_shapes[id(reference)]
    variable = optimizer.add_variable(
        (placement.data_parallel,) + tuple(full_shape),
        initializer="zeros",
        dtype=reference.dtype,
        name=f"{reference.path.replace('/', '_')}_{name}",
    )
    axis = placement.split_axis(reference)
    placement.place(variable, None if axis is None else axis + 1)
    placement.partition(variable, 0)
    return variable


def per_model_rank_variable(optimizer, placement, reference, start, name):
    """A variable equal on the data ranks, one value per model rank.

    PowerSGD's `Q` follows the gradient of a tensor-parallel shard, which
    differs from model rank to model rank, and is all-reduced over `data`.

    Args:
        optimizer: the `CoordinatedOptimizer` the variable belongs to.
        placement: the `Placement` that places it.
        reference: the trainable variable whose gradient it follows.
        start: the first value of every rank's copy, a NumPy array.
        name: suffix of the variable's name.
    """
    split = placement.split_axis(reference) is not None
    full = np.tile(start, (placement.tensor_parallel, 1)) if split else start

    def initializer(shape, dtype=None):
        return ops.convert_to_tensor(full, dtype=dtype)

    variable = optimizer.add_variable(
        full.shape,
        initializer=initializer,
        dtype=reference.dtype,
        name=f"{reference.path.replace('/', '_')}_{name}",
    )
    placement.place(variable, 0 if split else None)
    return variable
