"""How each supported Keras layer type is split, and its per-rank math.

A handler knows, for one layer type, which variables a style splits and on
which axis, which axis of the input and output is split, and how a rank
computes its part with `keras.ops` and the collective adapter. The math is
written on local (per-rank) tensors only, so it is the same for every
backend; the runtimes decide how the local tensors come to exist.
"""

import keras
import numpy as np
from keras import ops

from keras_tp.keras_internals import StatelessScope
from keras_tp.keras_internals import own_trainable_variables
from keras_tp.keras_internals import own_variables
from keras_tp.keras_internals import stored_kernel
from keras_tp.keras_internals import sublayers
from keras_tp.plan.styles import Channelwise
from keras_tp.plan.styles import Column
from keras_tp.plan.styles import ExpertParallel
from keras_tp.plan.styles import Row
from keras_tp.plan.styles import Vocab


def is_elementwise(activation):
    """Whether an activation acts on each feature independently.

    Decided by what it computes, not by its name: on a random batch, the
    activation of a slice of the features must equal the same slice of
    the activation of all of them (softmax, say, fails).
    """
    if activation is None:
        return True
    return _slices_commute(activation)


_SAMPLE = np.random.default_rng(0).normal(size=(2, 8)).astype("float32")
_ELEMENTWISE_CACHE = {}


def _slices_commute(function):
    key = id(function)
    if key not in _ELEMENTWISE_CACHE:
        try:
            whole = ops.convert_to_numpy(
                function(ops.convert_to_tensor(_SAMPLE))
            )
            part = ops.convert_to_numpy(
                function(ops.convert_to_tensor(_SAMPLE[:, :3]))
            )
            verdict = whole.shape == _SAMPLE.shape and np.allclose(
                whole[:, :3], part, rtol=1e-5, atol=1e-6
            )
        except Exception:  # noqa: BLE001 - not applicable to a slice
            verdict = False
        # Keep the function alive so its id is not reused.
        _ELEMENTWISE_CACHE[key] = (bool(verdict), function)
    return _ELEMENTWISE_CACHE[key][0]


class ShardingError(ValueError):
    """A plan asks for a split that cannot be done exactly."""


class LayerHandler:
    """Base class: the sharding rules of one family of leaf layers."""

    layer_types = ()
    styles = ()
    primary = "kernel"

    def matches(self, layer):
        return isinstance(layer, self.layer_types)

    def primary_role(self, layer):
        """The role of the variable whose path names the layer in plans."""
        return self.primary

    def primary_variable(self, layer):
        return self.variables(layer)[self.primary_role(layer)]

    def needs_region(self, style):
        """Whether the layer's call runs per rank through the handler.

        A layer that runs unchanged on each rank's values (its weights
        split in storage only) needs no region.
        """
        return True

    def variables(self, layer):
        """The layer's variables by role (`kernel`, `bias`, ...).

        With LoRA enabled, Keras' `kernel` property is the merged tensor;
        the roles are the frozen kernel and the two adapter factors.
        """
        roles = {self.primary: stored_kernel(layer, self.primary)}
        if roles[self.primary] is None:
            roles[self.primary] = getattr(layer, self.primary)
        bias = getattr(layer, "bias", None)
        if bias is not None:
            roles["bias"] = bias
        if getattr(layer, "lora_enabled", False):
            roles["lora_a"] = layer.lora_kernel_a
            roles["lora_b"] = layer.lora_kernel_b
        return roles

    def split_axes(self, layer, style):
        """`{role: axis or None}`: the axis each variable is split on."""
        raise NotImplementedError

    def split_size(self, layer, style):
        """Length of the split dimension, for divisibility checks."""
        role = self.primary_role(layer)
        kernel = self.variables(layer)[role]
        return kernel.shape[self.split_axes(layer, style)[role]]

    def unsupported_reason(self, layer):
        """Why this layer must stay replicated, or `None`."""
        if getattr(layer, "quantization_mode", None) is not None:
            return f"quantized ({layer.quantization_mode})"
        return None

    def lora_axes(self, layer, kernel_axis):
        """Split axes of the LoRA factors of a kernel split on `kernel_axis`.

        The merged kernel is `kernel + a @ b * alpha / rank`, with `a`
        shaped like the kernel but for its last axis (the rank) and `b`
        `(rank, last axis)`: a split of the last axis splits `b`'s columns,
        any other axis the same axis of `a`; the other factor stays whole.
        """
        if kernel_axis is None:
            return {"lora_a": None, "lora_b": None}
        if kernel_axis == len(stored_kernel(layer, "kernel").shape) - 1:
            return {"lora_a": None, "lora_b": 1}
        return {"lora_a": kernel_axis, "lora_b": None}

    def local_kernel(self, layer, style, adapter, weights):
        """This rank's kernel, with its LoRA update merged in.

        The factor that stays whole is read through `copy_to_parallel`:
        each rank's slice of the update gives only part of its gradient.
        """
        kernel = weights[self.primary]
        if "lora_a" not in weights:
            return kernel
        a, b = weights["lora_a"], weights["lora_b"]
        if self.split_axes(layer, style)["lora_a"] is None:
            a = adapter.copy_to_parallel(a)
        else:
            b = adapter.copy_to_parallel(b)
        update = ops.matmul(a, b) * (layer.lora_alpha / layer.lora_rank)
        return ops.cast(ops.add(kernel, update), kernel.dtype)

    def input_axis(self, layer, style, ndim):
        """Axis on which the layer's first input arrives split, or `None`."""
        return None

    def output_axis(self, layer, style, ndim):
        """Axis on which the layer's output leaves split, or `None`."""
        return None

    def parallel_input(self, style):
        """Whether a replicated input is consumed by split weights.

        Such an input enters through `copy_to_parallel`, whose backward pass
        all-reduces the input gradient.
        """
        return isinstance(style, Column)

    def local_call(self, layer, style, adapter, weights, inputs, **kwargs):
        """Computes this rank's output from its local `weights` by role."""
        raise NotImplementedError


def _finish(layer, style, adapter, x, bias, axis):
    """Adds the bias and applies the activation around the collective.

    A Row layer reduces its partial products before the (replicated) bias;
    a gathering Column layer gathers before the activation, so that an
    activation over features (softmax) sees all of them.
    """
    if isinstance(style, Row):
        x = adapter.reduce_from_parallel(x)
    if bias is not None:
        x = ops.add(x, bias)
    if isinstance(style, Column) and style.gather_output:
        x = adapter.gather_from_parallel(x, axis)
    if layer.activation is not None:
        x = layer.activation(x)
    return x


class DenseHandler(LayerHandler):
    layer_types = (keras.layers.Dense,)
    styles = (Column, Row)

    def split_axes(self, layer, style):
        if isinstance(style, Column):
            return {"kernel": 1, "bias": 0, **self.lora_axes(layer, 1)}
        return {"kernel": 0, "bias": None, **self.lora_axes(layer, 0)}

    def input_axis(self, layer, style, ndim):
        if isinstance(style, Row) and style.input_is_parallel:
            return ndim - 1
        return None

    def output_axis(self, layer, style, ndim):
        if isinstance(style, Column) and not style.gather_output:
            return ndim - 1
        return None

    def local_call(self, layer, style, adapter, weights, inputs, **kwargs):
        x = inputs
        if isinstance(style, Row) and not style.input_is_parallel:
            x = adapter.scatter_to_parallel(x, -1)
        x = ops.matmul(x, self.local_kernel(layer, style, adapter, weights))
        return _finish(layer, style, adapter, x, weights.get("bias"), -1)


class EinsumDenseHandler(LayerHandler):
    """EinsumDense, including attention projections.

    Column splits the first kernel axis that appears in the output but not
    in the input: the heads axis of a query/key/value projection. Row splits
    the first kernel axis contracted with the input: the heads axis of an
    attention output projection.
    """

    layer_types = (keras.layers.EinsumDense,)
    styles = (Column, Row)

    @staticmethod
    def _specs(layer):
        inputs, output = layer.equation.split("->")
        input_spec, kernel_spec = inputs.split(",")
        return input_spec, kernel_spec, output

    def _split_letter(self, layer, style):
        input_spec, kernel_spec, output_spec = self._specs(layer)
        for letter in kernel_spec:
            in_input = letter in input_spec
            in_output = letter in output_spec
            if isinstance(style, Column) and in_output and not in_input:
                return letter
            if isinstance(style, Row) and in_input and not in_output:
                return letter
        raise ShardingError(
            f"EinsumDense layer '{layer.path}' with equation "
            f"'{layer.equation}' has no kernel axis that {style!r} can split."
        )

    def unsupported_reason(self, layer):
        reason = super().unsupported_reason(layer)
        if (
            reason is None
            and "." in layer.equation.split("->")[0].split(",")[1]
        ):
            reason = "its kernel spec uses '...'"
        return reason

    def split_axes(self, layer, style):
        letter = self._split_letter(layer, style)
        _, kernel_spec, output_spec = self._specs(layer)
        axes = {"kernel": kernel_spec.index(letter), "bias": None}
        axes.update(self.lora_axes(layer, axes["kernel"]))
        if isinstance(style, Column) and layer.bias_axes:
            # The bias covers the output letters from its first one onward,
            # with size-1 axes for the letters it does not name.
            first = min(output_spec.index(c) for c in layer.bias_axes)
            bias_spec = output_spec[first:]
            if letter in layer.bias_axes:
                axes["bias"] = bias_spec.index(letter)
        return axes

    @staticmethod
    def _axis_from_end(spec, letter, ndim):
        letters = spec.replace("...", "")
        return ndim - (len(letters) - letters.index(letter))

    def input_axis(self, layer, style, ndim):
        if isinstance(style, Row) and style.input_is_parallel:
            input_spec = self._specs(layer)[0]
            letter = self._split_letter(layer, style)
            return self._axis_from_end(input_spec, letter, ndim)
        return None

    def output_axis(self, layer, style, ndim):
        if isinstance(style, Column) and not style.gather_output:
            output_spec = self._specs(layer)[2]
            letter = self._split_letter(layer, style)
            return self._axis_from_end(output_spec, letter, ndim)
        return None

    def local_call(self, layer, style, adapter, weights, inputs, **kwargs):
        x = inputs
        letter = self._split_letter(layer, style)
        input_spec, _, output_spec = self._specs(layer)
        if isinstance(style, Row) and not style.input_is_parallel:
            axis = self._axis_from_end(input_spec, letter, len(x.shape))
            x = adapter.scatter_to_parallel(x, axis)
        kernel = self.local_kernel(layer, style, adapter, weights)
        x = ops.einsum(layer.equation, x, kernel)
        out_axis = None
        if isinstance(style, Column):
            out_axis = self._axis_from_end(output_spec, letter, len(x.shape))
        return _finish(layer, style, adapter, x, weights.get("bias"), out_axis)


class ConvHandler(LayerHandler):
    """Conv1D/2D/3D: Column splits filters, Row splits input channels."""

    layer_types = (
        keras.layers.Conv1D,
        keras.layers.Conv2D,
        keras.layers.Conv3D,
    )
    styles = (Column, Row)

    def unsupported_reason(self, layer):
        reason = super().unsupported_reason(layer)
        if reason is None and layer.groups != 1:
            reason = f"grouped convolution (groups={layer.groups})"
        return reason

    def split_axes(self, layer, style):
        ndim = len(stored_kernel(layer, "kernel").shape)
        axis = ndim - 1 if isinstance(style, Column) else ndim - 2
        return {
            "kernel": axis,
            "bias": 0 if isinstance(style, Column) else None,
            **self.lora_axes(layer, axis),
        }

    @staticmethod
    def _channel_axis(layer, ndim):
        return ndim - 1 if layer.data_format == "channels_last" else 1

    def input_axis(self, layer, style, ndim):
        if isinstance(style, Row) and style.input_is_parallel:
            return self._channel_axis(layer, ndim)
        return None

    def output_axis(self, layer, style, ndim):
        if isinstance(style, Column) and not style.gather_output:
            return self._channel_axis(layer, ndim)
        return None

    def local_call(self, layer, style, adapter, weights, inputs, **kwargs):
        x = inputs
        axis = self._channel_axis(layer, len(x.shape))
        if isinstance(style, Row) and not style.input_is_parallel:
            x = adapter.scatter_to_parallel(x, axis)
        x = layer.convolution_op(
            x, self.local_kernel(layer, style, adapter, weights)
        )
        bias = weights.get("bias")
        if bias is not None:
            shape = [1] * len(x.shape)
            shape[axis] = bias.shape[0]
            bias = ops.reshape(bias, shape)
        return _finish(layer, style, adapter, x, bias, axis)


class EmbeddingHandler(LayerHandler):
    """Embedding: Vocab splits the table's rows; ids outside are masked.

    A `ReversibleEmbedding` also projects hidden states back to the
    vocabulary (`reverse=True`), the LM head of keras-hub models, through
    the same table (tied) or a table of its own (`reverse_embeddings`).
    That call is a Column on the vocabulary: each rank computes the logits
    of its rows, which are gathered.
    """

    layer_types = (keras.layers.Embedding,)
    styles = (Vocab,)
    primary = "embeddings"

    def variables(self, layer):
        roles = {"embeddings": layer.embeddings}
        reverse = getattr(layer, "reverse_embeddings", None)
        if reverse is not None:
            roles["reverse_embeddings"] = reverse
        return roles

    def split_axes(self, layer, style):
        return {"embeddings": 0, "reverse_embeddings": 1}

    def parallel_input(self, style):
        return False

    def local_call(self, layer, style, adapter, weights, inputs, **kwargs):
        if kwargs.get("reverse"):
            return self._local_logits(layer, adapter, weights, inputs)
        table = weights["embeddings"]
        rows = table.shape[0]
        ids = inputs
        if ids.dtype != "int32" and ids.dtype != "int64":
            ids = ops.cast(ids, "int32")
        local_ids = ids - adapter.rank() * rows
        in_range = ops.logical_and(local_ids >= 0, local_ids < rows)
        safe_ids = ops.where(in_range, local_ids, ops.zeros_like(local_ids))
        out = ops.take(table, safe_ids, axis=0)
        out = ops.where(ops.expand_dims(in_range, -1), out, 0)
        out = adapter.reduce_from_parallel(out)
        return ops.cast(out, layer.compute_dtype)

    @staticmethod
    def _local_logits(layer, adapter, weights, hidden):
        # The hidden states are whole on every rank and each rank's logits
        # read them: their gradient is summed over the ranks.
        hidden = adapter.copy_to_parallel(hidden)
        if layer.tie_weights:
            kernel = ops.transpose(weights["embeddings"])
        else:
            kernel = weights["reverse_embeddings"]
        if layer.reverse_dtype is not None:
            hidden = ops.cast(hidden, layer.reverse_dtype)
            kernel = ops.cast(kernel, layer.reverse_dtype)
        logits = adapter.gather_from_parallel(ops.matmul(hidden, kernel), -1)
        if layer.logit_soft_cap is not None:
            cap = layer.logit_soft_cap
            logits = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)
        return logits


class _LocalValues(StatelessScope):
    """Inside, the given variables read as this rank's values."""

    def __init__(self, values):
        super().__init__()
        self.values = values

    def get_current_value(self, variable):
        return self.values.get(id(variable))


class OwnWeightsHandler(LayerHandler):
    """A layer computing with weights of its own, in code keras_tp can't see.

    An expert bank written with raw `einsum`s, a BatchNormalization, a
    depthwise convolution: the layer's own `call` runs on each rank's
    slices of its weights, unchanged.

    - `Channelwise()` splits every weight on its channel axis: the one
      axis whose length all of the layer's weights share. The layer needs
      no region and no collective: its input arrives split (a `Column`
      output) and so does its output.
    - `ExpertParallel()` splits every weight on its leading (experts)
      axis; each rank's outputs are gathered or summed.

    Whether a split is exact depends on code keras_tp cannot see, so
    `auto_plan` only chooses these styles after checking them on the
    traced values.
    """

    styles = (Channelwise, ExpertParallel)

    def matches(self, layer):
        if not own_trainable_variables(layer):
            return False
        return not any(sub.weights for sub in sublayers(layer))

    def variables(self, layer):
        roles = {}
        for variable in own_variables(layer):
            role = variable.name
            while role in roles:
                role += "_"
            roles[role] = variable
        return roles

    def primary_role(self, layer):
        roles = self.variables(layer)
        return max(roles, key=lambda role: np.prod(roles[role].shape))

    def needs_region(self, style):
        return not isinstance(style, Channelwise)

    def split_axes(self, layer, style):
        variables = self.variables(layer)
        shapes = [tuple(v.shape) for v in variables.values()]
        if isinstance(style, ExpertParallel):
            if len({shape[:1] for shape in shapes}) != 1 or not shapes[0]:
                raise ShardingError(
                    f"Layer '{layer.path}': ExpertParallel() splits every "
                    "weight on its leading (experts) axis, but the weights "
                    f"have shapes {shapes}. Map it to Replicate()."
                )
            return {role: 0 for role in variables}
        length = self.channel_length(layer)
        if length is None:
            raise ShardingError(
                f"Layer '{layer.path}': Channelwise() splits every weight on "
                "its channel axis, the one axis length all its weights share,"
                f" but the weight shapes {shapes} have no such length. Map it "
                "to Replicate()."
            )
        return {
            role: tuple(v.shape).index(length) for role, v in variables.items()
        }

    def channel_length(self, layer):
        """The length every weight has on exactly one axis, or `None`."""
        shapes = [tuple(v.shape) for v in own_variables(layer)]
        lengths = {
            length
            for length in shapes[0]
            if all(shape.count(length) == 1 for shape in shapes)
        }
        return lengths.pop() if len(lengths) == 1 else None

    def parallel_input(self, style):
        return isinstance(style, ExpertParallel)

    def run_local(self, layer, weights, args, kwargs):
        """Runs the layer's own `call` with its weights read as `weights`."""
        variables = self.variables(layer)
        local = {id(variables[role]): value for role, value in weights.items()}
        with _LocalValues(local):
            return type(layer).call(layer, *args, **kwargs)

    def local_call(self, layer, style, adapter, weights, inputs, **kwargs):
        outputs = self.run_local(layer, weights, (inputs,), kwargs)
        if style.output_axis is None:
            return adapter.reduce_from_parallel(outputs)
        return adapter.gather_from_parallel(outputs, style.output_axis)


LEAF_HANDLERS = (
    DenseHandler(),
    EinsumDenseHandler(),
    ConvHandler(),
    EmbeddingHandler(),
    OwnWeightsHandler(),
)


def leaf_handler(layer):
    """The handler of a supported leaf layer, or `None`."""
    for handler in LEAF_HANDLERS:
        if handler.matches(layer):
            return handler
    return None


class AttentionUnit:
    """MultiHeadAttention / GroupQueryAttention as one sharded region.

    Query, key, value (and gate) projections are Column on the heads axis,
    the output projection is Row, and the attention core between them runs
    unchanged on each rank's heads. So the block costs one all-reduce
    forward (after the output projection) and one backward (for the input).
    """

    layer_types = (
        keras.layers.MultiHeadAttention,
        keras.layers.GroupQueryAttention,
    )

    def matches(self, layer):
        return isinstance(layer, self.layer_types)

    def projections(self, layer):
        """`{attribute: sublayer}` of the projections, column ones first."""
        names = ["_query_dense", "_key_dense", "_value_dense"]
        if getattr(layer, "_use_gate", False):
            names.append("_gate_dense")
        names.append("_output_dense")
        return {name: getattr(layer, name) for name in names}

    def heads(self, layer):
        """`(query_heads, key_value_heads)`."""
        if isinstance(layer, keras.layers.GroupQueryAttention):
            return layer.num_query_heads, layer.num_key_value_heads
        return layer.num_heads, layer.num_heads

    @staticmethod
    def projection_style(name):
        """The style of projection `name` when the unit is sharded."""
        return Row() if name == "_output_dense" else Column()

    def output_axes(self, layer, kwargs):
        """Output axes: the scores, if returned, stay split on heads."""
        if kwargs.get("return_attention_scores"):
            return (None, 1)
        return None


ATTENTION = AttentionUnit()
