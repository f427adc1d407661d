"""What keeps a Column's split features apart on their way to its Row.

Judged on the traced values: a layer keeps them apart when, run on the
first half of the features, it gives the same half of its traced output.
"""

import keras
import numpy as np
from keras import ops

from keras_tp.plan.layers import leaf_handler


def weightless_passing(call, tensor, axis, may_be_split):
    """The axis on which a weightless layer's output keeps `tensor`'s
    split features apart, or `None`.

    Run on the first half of the features (of `tensor`, and of each other
    input of that length on `axis` that broadcasts over another axis and
    `may_be_split`: a gate that another Column makes; an input of length 1
    on `axis` broadcasts as it is), the layer must give the same half of
    its traced output on an axis of that length: pooling over the other
    axes, a product with a squeeze-and-excitation gate. A `Reshape` that
    only adds or drops axes of length 1 keeps them apart too; a rank runs
    it with that axis of its target shape inferred (`open_target`).
    """
    if len(call.outputs) != 1 or tensor.shape[axis] < 2:
        return None
    output = call.output_values[0]
    if isinstance(call.layer, keras.layers.Reshape):
        out_axis = _unit_reshape_axis(tensor, output, axis)
        if out_axis is None or open_target(call.layer, output, out_axis):
            return out_axis
        return None
    length = tensor.shape[axis]
    part = np.arange(length // 2)
    sliced = {}
    for i, (other, value) in enumerate(zip(call.inputs, call.input_values)):
        if len(other.shape) != len(tensor.shape):
            return None
        if other is not tensor and other.shape[axis] == 1:
            continue
        if other is not tensor and not (
            other.shape[axis] == length
            and _broadcasts(other, tensor)
            and may_be_split(other)
        ):
            return None
        sliced[i] = take(value, part, axis)
    args, kwargs = call.arguments_with(sliced)
    try:
        actual = ops.convert_to_numpy(call.layer.call(*args, **kwargs))
        # The same at unit scale (see `at_unit_scale`).
        scaled = {i: at_unit_scale(call.input_values[i]) for i in sliced}
        args, kwargs = call.arguments_with(scaled)
        whole = ops.convert_to_numpy(call.layer.call(*args, **kwargs))
        args, kwargs = call.arguments_with(
            {i: take(value, part, axis) for i, value in scaled.items()}
        )
        at_scale = ops.convert_to_numpy(call.layer.call(*args, **kwargs))
    except Exception:  # noqa: BLE001 - the layer cannot run on a slice
        return None
    expected = ops.convert_to_numpy(output)
    for out_axis, size in enumerate(expected.shape):
        if size == length and _close(actual, np.take(expected, part, out_axis)):
            keeps = _close(at_scale, np.take(whole, part, out_axis))
            return out_axis if keeps else None
    return None


def _broadcasts(gate, tensor):
    """Whether one of `gate` and `tensor` spreads over an axis of the
    other (length 1 there).

    A squeeze-and-excitation gate broadcasts over the spatial axes; a
    residual has the shape of what it is added to, and is the stream
    between blocks, which Megatron keeps whole.
    """
    return any((g == 1) != (t == 1) for g, t in zip(gate.shape, tensor.shape))


def _unit_reshape_axis(tensor, output, axis):
    """Where a reshape that only adds or drops axes of length 1 puts
    `axis` of `tensor`, or `None` for any other reshape."""
    dims = [i for i, size in enumerate(tensor.shape) if size != 1]
    out_dims = [i for i, size in enumerate(output.shape) if size != 1]
    if [tensor.shape[i] for i in dims] != [output.shape[i] for i in out_dims]:
        return None
    return out_dims[dims.index(axis)]


def open_target(layer, output, axis):
    """`layer`'s target shape with `axis` of its `output` inferred (-1), so
    that it reshapes a rank's features as it reshapes all of them; `None`
    where another axis is inferred already."""
    target = list(layer.target_shape)
    if -1 in target and target.index(-1) != axis - 1:
        return None
    target[axis - 1] = -1
    return tuple(target)


def _close(actual, expected):
    return actual.shape == expected.shape and bool(
        np.allclose(actual, expected, rtol=1e-4, atol=1e-5)
    )


def take(tensor, indices, axis):
    return ops.convert_to_tensor(
        np.take(ops.convert_to_numpy(tensor), indices, axis),
        dtype=tensor.dtype,
    )


def commutes(call, tensor, axis, weights=None):
    """Whether `call`'s layer keeps the features on `axis` apart, in place.

    Decided by what the layer computes on the traced values: run on the
    first half of `tensor` along `axis` (with its weights read as
    `weights`, their matching halves, if given), it must give the same
    half of its traced output (an activation, dropout, pooling over other
    axes, a norm over another axis, BatchNormalization or a depthwise
    convolution with its weights halved do; a norm over `axis`, a reshape
    do not). Layers that change the shape stay out: XLA's CPU compiler
    crashes (`free(): invalid pointer`) on a rank's zero-padded, strided
    depthwise convolution read by a Row convolution.
    """
    if len(call.inputs) != 1 or len(call.outputs) != 1:
        return False
    output = call.output_values[0]
    if tuple(output.shape) != tuple(tensor.shape) or tensor.shape[axis] < 2:
        return False
    part = np.arange(tensor.shape[axis] // 2)
    value = call.input_values[0]
    for probe in (value, at_unit_scale(value)):
        try:
            whole = output if probe is value else call.layer.call(probe)
            sliced = take(probe, part, axis)
            if weights:
                handler = leaf_handler(call.layer)
                actual = handler.run_local(call.layer, weights, (sliced,), {})
            else:
                actual = call.layer.call(sliced)
            actual = ops.convert_to_numpy(actual)
        except Exception:  # noqa: BLE001 - the layer cannot run on a slice
            return False
        expected = np.take(ops.convert_to_numpy(whole), part, axis)
        if not _close(actual, expected):
            return False
    return True


def at_unit_scale(value):
    """`value` scaled to a root mean square of 1 (unchanged if all zero).

    Traced values can be tiny (a layer scale initialised at 1e-5): a norm
    over the channels then sits below its epsilon, where it is nearly
    linear and a rank's channels seem to give their part of its output.
    At unit scale it is not, and such a layer is split only if it keeps
    the channels apart there too.
    """
    array = ops.convert_to_numpy(value)
    if not np.issubdtype(array.dtype, np.floating):
        return value
    rms = float(np.sqrt(np.mean(np.square(array, dtype="float64"))))
    if rms == 0:
        return value
    return ops.convert_to_tensor(array / rms, dtype=value.dtype)
