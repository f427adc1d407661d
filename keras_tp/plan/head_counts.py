"""Head counts that a layer's own code reads from its config, per rank.

An attention layer written with raw ops reshapes its projections to the
head counts of its config: keras-hub's Gemma reshapes its query to
`(batch, length, num_key_value_heads, num_query_heads //
num_key_value_heads, head_dim)`. Where ranks hold their own slices
(torch, TensorFlow, JAX with a data axis) a rank holds `heads / T` of
those heads, so while it runs such a layer's code, the layer's integer
attributes that equal the full length of a heads axis its split
sublayers divide read the rank's count instead. A weight of the layer's
own with one value per head (GPT-OSS's attention sinks) stays whole, and
the rank reads its heads' slice of it (`HeadAxis`). A weightless
sublayer that reads the heads count from its input's shape (keras-hub's
`AlibiBias`) runs on all heads (`WholeHeads`). The planner's local
check (`verify`) runs the layer the same way and falls back where its
code still disagrees with one device.
"""

import collections
import contextlib
import threading

import keras
from keras import ops

from keras_tp.keras_internals import bind_values
from keras_tp.keras_internals import sublayers
from keras_tp.plan.arguments import HeadArgument
from keras_tp.plan.arguments import feature_arguments
from keras_tp.plan.arguments import local_arguments
from keras_tp.plan.attention import call_arguments
from keras_tp.plan.attention import named_arguments
from keras_tp.plan.rank_widths import RESHAPE
from keras_tp.plan.rank_widths import rank_widths
from keras_tp.plan.rank_widths import split_features

# TensorFlow's replicas run a layer's call in threads of their own, at
# the same time: the first to enter sets the counts, the last to leave
# restores them.
_LOCK = threading.Lock()
_ENTERED = {}


class HeadAxis(int):
    """The axis of a per-head weight, which a rank reads its slice of."""

    def __repr__(self):
        return f"HeadAxis({int(self)})"


class WholeHeads(int):
    """The heads axis of a weightless sublayer's input that the sublayer
    reads its heads count from: keras-hub's `AlibiBias` gives each head
    the slope of its index among `scores.shape[1]` heads. A rank runs it
    on all heads, its own in place and zeros elsewhere, and keeps its
    heads' slice of the output (`with_whole_heads`)."""

    def __repr__(self):
        return f"WholeHeads({int(self)})"


def per_rank_counts(model, plan, swapped=False):
    """`{layer: {attribute: count}}`: what each rank reads while it runs.

    A heads axis is a split axis of a split sublayer's kernel that another
    axis (the head size) follows inside the heads' features: an
    `EinsumDense` query `(hidden, heads, head_dim)` split as a Column, or
    its output projection `(heads, head_dim, hidden)` split as a Row. A
    `Dense` projection folds heads and head size into one split axis of
    width `W`: there a heads count is an integer attribute `n` of the
    layer, divisible by the ranks, with `W // n` another attribute (the
    head size; RoFormer's `heads` and `head_size`), the smallest such `n`
    unless `swapped` (Gemma3n's 4 heads of 8 beside other attributes of
    8: real models' head sizes, 64 to 256, outnumber their heads; the
    planner's check tries the others where that fails), and an attribute equal
    to `W` is the rank's width (GPT-NeoX reshapes its heads back to its
    `hidden_dim`). A Column that gathers its output, or a Row that slices
    its input, hands the layer whole heads and counts nothing.

    Args:
        model: the model `plan` is bound to, its variables unsplit.
        plan: a bound `ShardingPlan`.
        swapped: whether a `Dense` width's larger heads counts count too.

    Returns:
        For each layer whose direct sublayers split heads, its integer
        attributes equal to a full heads count, with the per-rank count,
        and its trainable weights with one axis of that length, with the
        `HeadAxis`.
    """
    counts = {}
    for layer, found in _layers_with_split_heads(model, plan):
        heads, widths, kernel_heads, others = found
        if swapped:
            heads = heads | others
        # A width counts beside heads only (a kernel's heads axis, or a
        # heads count and head size among the attributes): a `Dense` MLP's
        # split width is no attention's.
        counted = heads | widths if heads else heads
        own = {}
        for name, value in vars(layer).items():
            if type(value) is int and value in counted:
                own[name] = value // plan.tensor_parallel
            elif isinstance(value, keras.Variable) and value.trainable:
                axes = [i for i, n in enumerate(value.shape) if n in heads]
                if len(axes) == 1:
                    own[name] = HeadAxis(axes[0])
        if own:
            counts[layer] = own
    return counts


def _layers_with_split_heads(model, plan):
    """`[(layer, (heads, widths, kernel_heads, swapped)), ...]`: the layers
    whose direct sublayers split heads, with the full lengths of their
    heads axes, the widths of split axes that fold heads and head size
    together, the heads axes that a kernel has of its own, and the heads
    counts beside a smaller one of the same width (which are heads only
    where heads and head size swap)."""
    entries = {id(entry.layer): entry for entry in plan.leaf_layers()}
    regions = {id(entry.layer) for entry in plan.layers}
    found = []
    for layer in [model, *sublayers(model)]:
        if id(layer) in regions:
            continue  # an attention region's call runs on its heads already
        heads, widths = set(), set()
        for sub in sublayers(layer, recursive=False):
            if id(sub) in entries:
                axis_heads, axis_widths = _split_heads(entries[id(sub)])
                heads.update(axis_heads)
                widths.update(axis_widths)
        kernel_heads = set(heads)
        values = {v for v in vars(layer).values() if type(v) is int}
        others = set()
        for width in widths:
            counts = [
                n
                for n in values
                if 0 < n < width
                and width % n == 0
                and n % plan.tensor_parallel == 0
                and width // n in values
            ]
            if counts:
                heads.add(min(counts))
                others.update(counts)
        others -= heads
        if heads or widths:
            found.append((layer, (heads, widths, kernel_heads, others)))
    return found


def add_head_arguments(model, plan, trace):
    """Adds to `plan.per_rank_counts` the call arguments that carry a
    value for every head, which a rank reads its heads' slice of, and the
    weightless sublayers that may need all heads (`WholeHeads`).

    Falcon's decoder block makes the ALiBi bias `(batch, heads, 1,
    length)` for every head and passes it to its attention, which adds it
    to its own heads' scores. An argument counts where, in every traced
    call, it has one axis as long as a full heads count and no sublayer
    takes it whole (the hidden states the projections read); the heads
    are those of a split kernel's own heads axis. A weightless sublayer
    whose every call takes a first argument with one such axis and
    returns its shape (the scores' softmax, an ALiBi bias) may read the
    count from the shape. One that has such an axis by chance (a
    sequence as long as the heads count, Moonshine's rotary table), or
    that computes each head alone (a softmax), is dropped by the plan's
    check: its trials leave each name whole in turn
    (`local_check.counted_problems`), then `keep_needed_counts` drops
    those the check passes without.

    Args:
        model: the model `plan` is bound to.
        plan: a bound `ShardingPlan`.
        trace: the `Trace` of `model`.
    """
    # `(layer, its kernels' full heads counts, whether it is an attention
    # unit)`: a unit (a `ShardedUnit`, which has projections) runs its own
    # sublayers on its heads inside its region.
    owners = [
        (layer, found[2], False)
        for layer, found in _layers_with_split_heads(model, plan)
    ]
    owners += [
        (entry.layer, _unit_heads(entry), True)
        for entry in plan.layers
        if hasattr(entry, "projections")
    ]
    for layer, heads, unit in owners:
        axes = collections.defaultdict(set)
        for call in trace.calls_of[id(layer)]:
            taken = {
                id(tensor)
                for child in trace.children[call.index]
                for tensor in child.inputs
            }
            named = named_arguments(layer, *call.arguments)
            # The batch of the layer's main input: a first axis as long
            # is a batch, heads only by chance (GPT2's attention mask).
            first = tuple(getattr(named[0][1], "shape", ())) if named else ()
            batch = first[0] if first else None
            for name, value in named:
                if id(value) in taken or not hasattr(value, "shape"):
                    continue
                matching = [
                    (i, n)
                    for i, n in enumerate(value.shape)
                    if n in heads and not (i == 0 and n == batch)
                ]
                axes[name].add(matching[0] if len(matching) == 1 else None)
        found = {
            name: HeadArgument(*axis)
            for name, (axis, *others) in axes.items()
            if axis is not None and not others
        }
        for owner, counts in [
            (layer, found),
            *([] if unit else _whole_heads(layer, trace, heads)),
        ]:
            if counts:
                plan.per_rank_counts[owner] = {
                    **plan.per_rank_counts.get(owner, {}),
                    **counts,
                }


def _unit_heads(unit):
    """The full heads counts of an attention unit's split projections."""
    heads = set()
    for member in unit.projections.values():
        heads.update(_split_heads(member)[0])
    return heads


def _whole_heads(layer, trace, heads):
    """`[(sublayer, {argument: WholeHeads(axis)}), ...]`: the weightless
    direct sublayers of `layer` whose every traced call takes a first
    argument with one axis of a length in `heads`, and returns a tensor of
    its shape."""
    axes = collections.defaultdict(set)
    for call in trace.calls_of[id(layer)]:
        for child in trace.children[call.index]:
            if child.layer.weights or not child.inputs:
                axes[id(child.layer)].add(None)
                continue
            first = tuple(child.inputs[0].shape)
            matching = [i for i, n in enumerate(first) if n in heads]
            returns = [tuple(t.shape) for t in child.outputs] == [first]
            axes[id(child.layer)].add(
                matching[0] if len(matching) == 1 and returns else None
            )
    found = []
    for sub in sublayers(layer, recursive=False):
        axis, *others = axes.get(id(sub), {None})
        if axis is not None and not others:
            name = call_arguments(sub)[0]
            found.append((sub, {name: WholeHeads(axis)}))
    return found


def _split_heads(entry):
    """`(heads, widths)`: the full length of the heads axis a split
    kernel divides, or the width of its split axis where that folds heads
    and head size into one (a `Dense`'s)."""
    found = split_features(entry)
    if found is None:
        return (), ()
    shape, axis, last = found
    if axis == last:
        return (), (shape[axis],)
    return (shape[axis],), ()


@contextlib.contextmanager
def local_counts(layer, counts, head_slice):
    """Inside, `layer`'s attributes read `counts` (`{name: count}`), its
    per-head weights (a `HeadAxis` in `counts`) `head_slice(weight,
    axis)`, and its reshapes the rank's widths (`rank_widths`)."""
    weights = [
        (getattr(layer, name), axis)
        for name, axis in counts.items()
        if isinstance(axis, HeadAxis)
    ]
    widths = counts.get(RESHAPE)
    counts = {
        name: count
        for name, count in counts.items()
        if name != RESHAPE
        and not isinstance(count, (HeadAxis, HeadArgument, WholeHeads))
    }
    with (
        _assigned(layer, counts),
        bind_values(
            (weight, head_slice(weight, int(axis))) for weight, axis in weights
        ),
        rank_widths(widths),
    ):
        yield


@contextlib.contextmanager
def _assigned(layer, counts):
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
    their own slices (JAX without a data axis runs it on whole heads). A
    per-head weight or argument is read through `scatter_to_parallel`:
    each rank's slice forward, its gradient gathered whole from the
    ranks' slices."""
    call = layer.call

    def head_slice(weight, axis):
        value = runtime.local_value(weight)
        return runtime.adapter.scatter_to_parallel(value, axis)

    def ranks():
        return runtime.adapter.rank(), runtime.adapter.size()

    local_call = with_whole_heads(counts, call, ranks)

    def split_on_devices(value, axis):
        return runtime.run_split_function(
            lambda adapter, whole: adapter.scatter_to_parallel(whole, axis),
            [value],
            [None],
            output_axis=axis,
        )

    features = feature_arguments(counts)

    def counted_call(*args, **kwargs):
        if not runtime.holds_local_values():
            if features and not runtime.local_ranks:
                # On global arrays too, each device takes its part of an
                # argument multiplied into split features, in a counted
                # scatter, where XLA would gather the gradient uncounted.
                args, kwargs = local_arguments(
                    layer, features, split_on_devices, args, kwargs
                )
            return call(*args, **kwargs)
        args, kwargs = local_arguments(
            layer, counts, runtime.adapter.scatter_to_parallel, args, kwargs
        )
        with local_counts(layer, counts, head_slice):
            return local_call(*args, **kwargs)

    return counted_call


def with_whole_heads(counts, call, ranks):
    """`call`, run on all heads where `counts` holds a `WholeHeads` axis
    for its first argument: the rank's heads in their place among zeros,
    its heads' slice of the output kept. `ranks()` gives `(rank, ranks)`,
    the rank perhaps a traced scalar; no collective runs."""
    axes = [a for a in counts.values() if isinstance(a, WholeHeads)]
    if not axes:
        return call
    axis = int(axes[0])

    def whole_heads_call(inputs, *args, **kwargs):
        rank, size = ranks()
        own = [ops.cast(ops.equal(rank, r), inputs.dtype) for r in range(size)]
        padded = ops.concatenate([inputs * keep for keep in own], axis)
        outputs = call(padded, *args, **kwargs)
        blocks = ops.split(outputs, size, axis)
        return sum(
            block * ops.cast(keep, block.dtype)
            for block, keep in zip(blocks, own)
        )

    return whole_heads_call


def _assign(layer, values):
    for name, value in values.items():
        # Bypass Keras' attribute tracking: these are plain numbers.
        object.__setattr__(layer, name, value)
