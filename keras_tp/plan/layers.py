"""The handlers of Keras' own splittable layers, and the handler registry.

Dense, EinsumDense (attention projections included), convolutions
(separable ones included) and embeddings each have a handler (see
`keras_tp.plan.handler`); any other layer with weights of its own is
handled by `OwnWeightsHandler`.
"""

import keras
from keras import ops

from keras_tp.errors import ShardingError
from keras_tp.keras_internals import stored_kernel
from keras_tp.plan.handler import LayerHandler
from keras_tp.plan.own_weights import OwnWeightsHandler
from keras_tp.plan.split_logits import logits_stay_split
from keras_tp.plan.styles import Channelwise
from keras_tp.plan.styles import Column
from keras_tp.plan.styles import Row
from keras_tp.plan.styles import Vocab


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
    if (
        isinstance(style, Column)
        and style.gather_output
        and not logits_stay_split(layer)
    ):
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
        groups = getattr(layer, "groups", 1)  # separable ones have none
        if reason is None and groups != 1:
            reason = f"grouped convolution (groups={groups})"
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

    @staticmethod
    def _finish_channels(layer, style, adapter, weights, x, axis):
        """`_finish` with the bias broadcast along the channel `axis`."""
        bias = weights.get("bias")
        if bias is not None:
            shape = [1] * len(x.shape)
            shape[axis] = bias.shape[0]
            bias = ops.reshape(bias, shape)
        return _finish(layer, style, adapter, x, bias, axis)

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
        return self._finish_channels(layer, style, adapter, weights, x, axis)


_DEPTHWISE = (keras.layers.DepthwiseConv1D, keras.layers.DepthwiseConv2D)


class ChannelConvHandler(OwnWeightsHandler):
    """A convolution that filters each block of channels on its own.

    A DepthwiseConv1D/2D, or a grouped convolution (`groups > 1`:
    MobileNet's and ConvNeXt's depthwise convolution written as
    `Conv2D(groups=channels)`). Split by `Channelwise()`, each rank
    convolves its block of channels (its groups) with its block of the
    kernel and bias, in Keras' own math written here: the layer's `call`
    checks its input and bias against the whole weights' shapes.
    """

    def matches(self, layer):
        # A causal Conv1D pads in its own `call`: it stays a `ConvHandler`
        # layer, kept whole.
        return isinstance(layer, _DEPTHWISE) or (
            isinstance(layer, ConvHandler.layer_types)
            and layer.groups > 1
            and layer.padding != "causal"
        )

    def call_on_local_values(self, layer, runtime):
        """Each rank convolves its channels, where its values are or in a
        function mapped over the ranks (`runtime.run_split_function`): on
        global arrays, XLA would gather a grouped convolution's input and
        kernel rather than split it by its groups."""
        variables = self.variables(layer)
        axes = self.split_axes(layer, Channelwise())

        def call(inputs, **kwargs):
            def local(adapter, x, *weights):
                weights = dict(zip(variables, weights))
                return self.run_local(layer, weights, (x,), kwargs)

            axis = ConvHandler._channel_axis(layer, len(inputs.shape))
            return runtime.run_split_function(
                local,
                (inputs, *map(runtime.local_value, variables.values())),
                (axis, *map(axes.get, variables)),
                output_axis=axis,
            )

        return call

    def run_local(self, layer, weights, args, kwargs):
        x = args[0]
        axis = ConvHandler._channel_axis(layer, len(x.shape))
        depthwise = isinstance(layer, _DEPTHWISE)
        x = (ops.depthwise_conv if depthwise else ops.conv)(
            x,
            weights["kernel"],
            strides=layer.strides,
            padding=layer.padding,
            dilation_rate=layer.dilation_rate,
            data_format=layer.data_format,
        )
        return ConvHandler._finish_channels(
            layer, Channelwise(), None, weights, x, axis
        )


class SeparableConvHandler(ConvHandler):
    """SeparableConv1D/2D: a depthwise then a pointwise (1x1) convolution.

    Column splits the pointwise filters: the depthwise kernel stays whole
    and is read through `copy_to_parallel`, since each rank's filters give
    only part of its gradient. Row splits the input channels, of both
    kernels: each rank filters its channels depthwise, and its pointwise
    product is a partial sum of the output.
    """

    layer_types = (
        keras.layers.SeparableConv1D,
        keras.layers.SeparableConv2D,
    )
    primary = "pointwise_kernel"

    def variables(self, layer):
        roles = {
            "depthwise_kernel": layer.depthwise_kernel,
            "pointwise_kernel": layer.pointwise_kernel,
        }
        if layer.bias is not None:
            roles["bias"] = layer.bias
        return roles

    def split_axes(self, layer, style):
        # Both kernels keep their channel axes second to last; depthwise
        # outputs of a channel are consecutive, so a block of input
        # channels is a block of the pointwise kernel's inputs.
        axis = len(layer.pointwise_kernel.shape) - 2
        if isinstance(style, Column):
            return {
                "depthwise_kernel": None,
                "pointwise_kernel": axis + 1,
                "bias": 0,
            }
        return {
            "depthwise_kernel": axis,
            "pointwise_kernel": axis,
            "bias": None,
        }

    def split_size(self, layer, style):
        if isinstance(style, Column):
            return layer.filters
        return layer.depthwise_kernel.shape[-2]

    def local_call(self, layer, style, adapter, weights, inputs, **kwargs):
        x = inputs
        axis = self._channel_axis(layer, len(x.shape))
        depthwise = weights["depthwise_kernel"]
        if isinstance(style, Column):
            depthwise = adapter.copy_to_parallel(depthwise)
        elif not style.input_is_parallel:
            x = adapter.scatter_to_parallel(x, axis)
        x = ops.separable_conv(
            x,
            depthwise,
            weights["pointwise_kernel"],
            strides=layer.strides,
            padding=layer.padding,
            dilation_rate=layer.dilation_rate,
            data_format=layer.data_format,
        )
        return self._finish_channels(layer, style, adapter, weights, x, axis)


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
        # The LM head's hidden states (`reverse=True`) are whole on every
        # rank and each rank's logits read them: they enter through
        # `copy_to_parallel` (or, under sequence parallelism, are gathered
        # from their sequence shards). The token ids of a lookup carry no
        # gradient.
        return True

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
        if layer.tie_weights:
            kernel = ops.transpose(weights["embeddings"])
        else:
            kernel = weights["reverse_embeddings"]
        if layer.reverse_dtype is not None:
            hidden = ops.cast(hidden, layer.reverse_dtype)
            kernel = ops.cast(kernel, layer.reverse_dtype)
        logits = ops.matmul(hidden, kernel)
        if not logits_stay_split(layer):
            logits = adapter.gather_from_parallel(logits, -1)
        if layer.logit_soft_cap is not None:
            cap = layer.logit_soft_cap
            logits = ops.multiply(ops.tanh(ops.divide(logits, cap)), cap)
        return logits


LEAF_HANDLERS = (
    DenseHandler(),
    EinsumDenseHandler(),
    ChannelConvHandler(),
    ConvHandler(),
    SeparableConvHandler(),
    EmbeddingHandler(),
    OwnWeightsHandler(),
)


def leaf_handler(layer):
    """The handler of a supported leaf layer, or `None`."""
    for handler in LEAF_HANDLERS:
        if handler.matches(layer):
            return handler
    return None
