"""`auto_plan`: a Megatron plan decided from shapes and the layer graph."""

import collections

import keras
from keras import ops

from keras_tp.plan.layers import ATTENTION
from keras_tp.plan.layers import ShardingError
from keras_tp.plan.layers import is_elementwise
from keras_tp.plan.layers import leaf_handler
from keras_tp.plan.sharding_plan import ShardingPlan
from keras_tp.plan.sharding_plan import check_shardable
from keras_tp.plan.sharding_plan import supported_layers
from keras_tp.plan.sharding_plan import tied_variables
from keras_tp.plan.sharding_plan import walk_layers
from keras_tp.plan.styles import Column
from keras_tp.plan.styles import Row
from keras_tp.plan.styles import Vocab

# Layers that act on every feature independently and keep the shape, so
# a Column output can flow through them to its Row consumer.
_ELEMENTWISE_LAYERS = (
    keras.layers.Dropout,
    keras.layers.GaussianNoise,
    keras.layers.GaussianDropout,
    keras.layers.ReLU,
    keras.layers.LeakyReLU,
    keras.layers.ELU,
    keras.layers.Identity,
)
_POOLING_LAYERS = (
    keras.layers.MaxPooling1D,
    keras.layers.MaxPooling2D,
    keras.layers.MaxPooling3D,
    keras.layers.AveragePooling1D,
    keras.layers.AveragePooling2D,
    keras.layers.AveragePooling3D,
)

Call = collections.namedtuple("Call", ["layer", "inputs", "outputs"])


def auto_plan(model, world_size):
    """Returns the plan `TensorParallelKeras(model, plan="auto")` applies.

    The planner runs the model once on a zero batch of one example and
    records which layer consumes which layer's output. It then pairs a
    Column layer with the Row layer that consumes its output, through
    elementwise layers only (activations, dropout, pooling over the
    other axes), as Megatron does: an MLP costs one all-reduce forward and
    one backward. Attention layers are split by heads, embeddings by
    vocabulary rows. A supported layer left unpaired is split as a Column
    that gathers its output, or else as a Row that slices its input, so its
    memory is still divided. Layers the planner does not support, and
    dimensions that do not divide by `world_size`, stay replicated, with
    the reason in `plan.replicated`.

    Args:
        model: a built Keras model (Sequential, Functional or subclassed).
        world_size: number of tensor-parallel ranks.

    Returns:
        A `ShardingPlan` bound to `model`.

    Example:

    >>> plan = keras_tp.auto_plan(model, world_size=2)
    >>> print(plan)
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}.")
    calls = trace_layer_calls(model)
    tied = tied_variables(model)
    planner = _Planner(world_size, tied, calls)
    rules = {}
    reasons = {}
    for layer in supported_layers(model):
        if ATTENTION.matches(layer):
            reason = planner.attention_reason(layer)
            if reason is None:
                for name, sub in ATTENTION.projections(layer).items():
                    rules[_primary_path(sub)] = ATTENTION.projection_style(name)
            else:
                reasons[layer.path] = reason
    styles, leaf_reasons = planner.leaf_styles(
        [
            layer
            for layer in supported_layers(model)
            if not ATTENTION.matches(layer)
        ]
    )
    for layer, style in styles:
        rules[_primary_path(layer)] = style
    reasons.update(leaf_reasons)
    plan = ShardingPlan(rules).bind(model, world_size)
    plan.replicated.update(reasons)
    return plan


def _primary_path(layer):
    handler = leaf_handler(layer)
    return handler.variables(layer)[handler.primary].path


class _Planner:
    def __init__(self, world_size, tied, calls):
        self.world_size = world_size
        self.tied = tied
        self.calls = calls
        self.consumers = collections.defaultdict(list)
        self.calls_of = collections.defaultdict(list)
        for call in calls:
            self.calls_of[id(call.layer)].append(call)
            for tensor in call.inputs:
                self.consumers[id(tensor)].append(call)

    def reason(self, layer, style):
        """Why `style` cannot split `layer`, or `None` if it can."""
        handler = leaf_handler(layer)
        try:
            check_shardable(layer, handler, style, self.world_size, self.tied)
        except ShardingError as error:
            return str(error)
        return None

    def attention_reason(self, layer):
        query_heads, kv_heads = ATTENTION.heads(layer)
        if query_heads % self.world_size or kv_heads % self.world_size:
            return (
                f"{query_heads} query and {kv_heads} key/value heads do not "
                f"divide by world_size={self.world_size}"
            )
        for name, sub in ATTENTION.projections(layer).items():
            reason = self.reason(sub, ATTENTION.projection_style(name))
            if reason:
                return reason
        return None

    def leaf_styles(self, layers):
        """Pairs Column→Row, then splits the rest where it divides."""
        styles = {}
        candidates = {id(layer) for layer in layers}
        for call in self.calls:
            layer = call.layer
            if id(layer) in styles or id(layer) not in candidates:
                continue
            if len(self.calls_of[id(layer)]) != 1:
                continue
            row = self._row_partner(call)
            if (
                row is not None
                and id(row) in candidates
                and id(row) not in styles
            ):
                styles[id(layer)] = (layer, Column())
                styles[id(row)] = (row, Row())
        reasons = {}
        for layer in layers:
            if id(layer) in styles:
                continue
            if not self.calls_of[id(layer)]:
                reasons[layer.path] = "not called when the model was traced"
                continue
            for style in (Vocab(), Column(gather_output=True), Row(False)):
                if isinstance(style, leaf_handler(layer).styles):
                    reason = self.reason(layer, style)
                    if reason is None:
                        styles[id(layer)] = (layer, style)
                        break
                    reasons[layer.path] = reason
            if id(layer) in styles:
                reasons.pop(layer.path, None)
        order = {id(layer): i for i, layer in enumerate(layers)}
        ordered = sorted(
            styles.values(), key=lambda item: order.get(id(item[0]), 0)
        )
        return ordered, reasons

    def _row_partner(self, call):
        """The layer that can be Row for `call`'s Column output, or `None`."""
        column = call.layer
        handler = leaf_handler(column)
        if Column not in handler.styles or self.reason(column, Column()):
            return None
        if len(call.outputs) != 1:
            return None
        tensor = call.outputs[0]
        ndim = len(tensor.shape)
        axis = handler.output_axis(column, Column(), ndim)
        width = tensor.shape[axis]
        while True:
            consumers = self.consumers[id(tensor)]
            if len(consumers) != 1:
                return None
            nxt = consumers[0]
            if _passes_split_axis(nxt, axis, ndim, width):
                tensor = nxt.outputs[0]
                continue
            break
        row = nxt.layer
        row_handler = leaf_handler(row)
        if row_handler is None or Row not in row_handler.styles:
            return None
        if len(self.calls_of[id(row)]) != 1 or nxt.inputs[0] is not tensor:
            return None
        if self.reason(row, Row()):
            return None
        if row_handler.input_axis(row, Row(), ndim) != axis:
            return None
        if row_handler.split_size(row, Row()) != width:
            return None
        return row


def _passes_split_axis(call, axis, ndim, width):
    """Whether `call` keeps features on `axis` independent and in place."""
    layer = call.layer
    if len(call.inputs) != 1 or len(call.outputs) != 1:
        return False
    out = call.outputs[0]
    if len(out.shape) != ndim or out.shape[axis] != width:
        return False
    if isinstance(layer, _ELEMENTWISE_LAYERS):
        return True
    if isinstance(layer, keras.layers.Activation):
        return is_elementwise(layer.activation)
    if isinstance(layer, _POOLING_LAYERS):
        channels_last = layer.data_format == "channels_last"
        return axis == (ndim - 1 if channels_last else 1)
    return False


def trace_layer_calls(model):
    """Runs `model` on zeros and records every layer call, in order.

    Returns a list of `Call(layer, inputs, outputs)` with the flattened
    input and output tensors (kept alive, so their ids stay unique).
    """
    inputs = example_inputs(model)
    calls = []
    patched = []
    for layer in walk_layers(model):
        patched.append((layer, layer.__dict__.get("call")))
        object.__setattr__(layer, "call", _recording(layer, layer.call, calls))
    try:
        model(inputs, training=False)
    finally:
        for layer, previous in patched:
            if previous is None:
                object.__delattr__(layer, "call")
            else:
                object.__setattr__(layer, "call", previous)
    return calls


def _recording(layer, call, calls):
    def recording_call(*args, **kwargs):
        outputs = call(*args, **kwargs)
        flat_in = [
            t for t in keras.tree.flatten((args, kwargs)) if _is_tensor(t)
        ]
        flat_out = [t for t in keras.tree.flatten(outputs) if _is_tensor(t)]
        calls.append(Call(layer, flat_in, flat_out))
        return outputs

    return recording_call


def _is_tensor(value):
    return hasattr(value, "shape") and hasattr(value, "dtype")


def example_inputs(model):
    """Zeros shaped like `model`'s inputs, batch 1 (unknown dims: 2)."""
    symbolic = getattr(model, "_inputs_struct", None)
    if symbolic is None:
        symbolic = getattr(model, "inputs", None) or None
        if isinstance(model, keras.Sequential) and symbolic:
            symbolic = symbolic[0]  # Sequential takes one tensor, not a list
    if symbolic is not None:
        return keras.tree.map_structure(
            lambda t: ops.zeros(_concrete(t.shape, batch=True), dtype=t.dtype),
            symbolic,
        )
    shapes = getattr(model, "_build_shapes_dict", None)
    if model.built and shapes and len(shapes) == 1:
        shape = next(iter(shapes.values()))
        return keras.tree.map_shape_structure(
            lambda s: ops.zeros(_concrete(s, batch=True)), shape
        )
    raise ValueError(
        f"Model '{model.name}' has no known input shape. Build it first: "
        "call `model.build(input_shape)` or run it once on a batch, then "
        "wrap it in TensorParallelKeras."
    )


def _concrete(shape, batch):
    dims = list(shape)
    if dims and batch and dims[0] is None:
        dims[0] = 1
    return tuple(2 if d is None else int(d) for d in dims)
