"""Tensors of a layer's call arguments that reach split features.

Gemma3n's decoder block multiplies its per-layer input, which its caller
made whole, into its gate's output, split by features, before the
projection back: a rank must multiply its features by its slice of that
input. The trace does not record the multiply (a raw op), so the
dataflow tells: the parent call runs again with the first rank's part of
a candidate tensor NaN (`dependence.argument_carries_rank_parts`).
"""

from keras_tp.plan import dependence
from keras_tp.plan.arguments import FeatureArgument
from keras_tp.plan.attention import named_arguments
from keras_tp.plan.layers import leaf_handler
from keras_tp.plan.styles import Row
from keras_tp.plan.trace import flat_tensors
from keras_tp.tensors import is_float


def add_feature_arguments(model, plan, trace):
    """Adds to `plan.per_rank_counts` the tensors in a layer's call
    arguments that its own code carries into a split Row's input, each
    rank's part to that rank's part (`FeatureArgument`).

    For each call of a Row that takes split input, inside a layer's call
    (not inside an attention unit, whose region runs on its heads), each
    floating tensor of that call's arguments that no sublayer takes whole,
    and that has an axis as long as the Row's split input, is a candidate
    on that axis. The parent call runs again with the first rank's part of
    the candidate NaN (`dependence.argument_carries_rank_parts`): it is a
    feature argument where the Row's input is then NaN in its first rank's
    part, and only there, in every call of the layer.

    Args:
        model: the model `plan` is bound to.
        plan: a bound `ShardingPlan`.
        trace: the `Trace` of `model`.
    """
    inside_units = plan.unit_members()
    found = {}
    for entry in plan.leaf_layers():
        style = entry.style
        if not (isinstance(style, Row) and style.input_is_parallel):
            continue
        if id(entry.layer) in inside_units:
            continue
        for row in trace.calls_of[id(entry.layer)]:
            if row.parent is None or not row.inputs:
                continue
            parent = trace.calls[row.parent]
            arguments = _carried(model, trace, row, parent, plan)
            calls = found.setdefault(id(parent.layer), [parent.layer, {}])[1]
            calls[parent.index] = calls.get(parent.index, set()) | arguments
    for layer, calls in found.values():
        every = set.intersection(*calls.values())
        names = [name for name, *_ in every]
        counts = {
            name: FeatureArgument(axis, width, part)
            for name, part, axis, width in every
            if names.count(name) == 1
        }
        if counts:
            plan.per_rank_counts[layer] = {
                **plan.per_rank_counts.get(layer, {}),
                **counts,
            }


def _carried(model, trace, row, parent, plan):
    """`{(name, part, axis, width)}`: the tensors of `parent`'s arguments
    that carry each rank's part to that rank's part of `row`'s input."""
    ndim = len(row.inputs[0].shape)
    row_axis = leaf_handler(row.layer).input_axis(row.layer, Row(), ndim)
    width = row.inputs[0].shape[row_axis]
    taken = {
        id(tensor)
        for child in trace.children[parent.index]
        for tensor in child.inputs
    }
    named = [
        (name, part, tensor)
        for name, value in named_arguments(parent.layer, *parent.arguments)
        for part, tensor in enumerate(flat_tensors(value))
    ]
    carried = set()
    for position, tensor in enumerate(parent.inputs):
        if id(tensor) in taken or not is_float(tensor):
            continue
        where = [(n, p) for n, p, t in named if t is tensor]
        if len(where) != 1:
            continue  # the same tensor twice: no one argument to slice
        for axis, length in enumerate(tensor.shape):
            if length == width and dependence.argument_carries_rank_parts(
                model, trace, row, position, axis, plan.tensor_parallel
            ):
                carried.add((*where[0], axis, width))
    return carried
