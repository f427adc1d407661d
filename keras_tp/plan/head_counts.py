"""Head counts that a layer's own code reads from its config, per rank.

An attention layer written with raw ops reshapes its projections to the
head counts of its config: keras-hub's Gemma reshapes its query to
`(batch, length, num_key_value_heads, num_query_heads //
num_key_value_heads, head_dim)`. Where ranks hold their own slices
(torch, TensorFlow, JAX with a data axis) a rank holds `heads / T` of
those heads, so while it runs such a layer's code, the layer's integer
attributes that equal the full length of a heads axis its split
sublayers divide read the rank's count instead. The planner's local
check (`verify`) runs the layer the same way and falls back where its
code still disagrees with one device.
"""

import contextlib
import threading

from keras_tp.keras_internals import sublayers
from keras_tp.plan.styles import Column
from keras_tp.plan.styles import Row

# TensorFlow's replicas run a layer's call in threads of their own, at
# the same time: the first to enter sets the counts, the last to leave
# restores them.
_LOCK = threading.Lock()
_ENTERED = {}


def per_rank_counts(model, plan):
    """`{layer: {attribute: count}}`: what each rank reads while it runs.

    A heads axis is a split axis of a split sublayer's kernel that another
    axis (the head size) follows inside the heads' features: an
    `EinsumDense` query `(hidden, heads, head_dim)` split as a Column, or
    its output projection `(heads, head_dim, hidden)` split as a Row. A
    Column that gathers its output, or a Row that slices its input, hands
    the layer whole heads and counts nothing.

    Args:
        model: the model `plan` is bound to, its variables unsplit.
        plan: a bound `ShardingPlan`.

    Returns:
        For each layer whose direct sublayers split heads, its integer
        attributes equal to a full heads count, with the per-rank count.
    """
    entries = {id(entry.layer): entry for entry in plan.leaf_layers()}
    regions = {id(entry.layer) for entry in plan.layers}
    counts = {}
    for layer in [model, *sublayers(model)]:
        if id(layer) in regions:
            continue  # an attention region's call runs on its heads already
        heads = set()
        for sub in sublayers(layer, recursive=False):
            if id(sub) in entries:
                heads.update(_split_heads(entries[id(sub)]))
        own = {
            name: value // plan.tensor_parallel
            for name, value in vars(layer).items()
            if type(value) is int and value in heads
        }
        if own:
            counts[layer] = own
    return counts


def _split_heads(entry):
    style = entry.style
    if isinstance(style, Column) and not style.gather_output:
        features_after = 1  # the head size
    elif isinstance(style, Row) and style.input_is_parallel:
        features_after = 2  # the head size, then the output features
    else:
        return ()
    role = entry.handler.primary_role(entry.layer)
    axis = entry.axes.get(role)
    shape = tuple(entry.handler.variables(entry.layer)[role].shape)
    if axis is None or axis >= len(shape) - features_after:
        return ()
    return (shape[axis],)


@contextlib.contextmanager
def local_counts(layer, counts):
    """Inside, `layer`'s attributes read `counts` (`{name: count}`)."""
    with _LOCK:
        entered = _ENTERED.setdefault(id(layer), [0, {}])
        if entered[0] == 0:
            entered[1] = {name: getattr(layer, name) for name in counts}
            _assign(layer, counts)
        entered[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            entered[0] -= 1
            if entered[0] == 0:
                _assign(layer, entered[1])
                del _ENTERED[id(layer)]


def call_with_local_counts(layer, counts, runtime):
    """`layer`'s call, reading `counts` where the runtime's ranks hold
    their own slices (JAX without a data axis runs it on whole heads)."""
    call = layer.call

    def counted_call(*args, **kwargs):
        if not runtime.holds_local_values():
            return call(*args, **kwargs)
        with local_counts(layer, counts):
            return call(*args, **kwargs)

    return counted_call


def _assign(layer, values):
    for name, value in values.items():
        # Bypass Keras' attribute tracking: these are plain numbers.
        object.__setattr__(layer, name, value)
