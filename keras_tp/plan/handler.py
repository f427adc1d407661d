"""`LayerHandler`: what a handler knows about splitting one layer type.

A handler knows, for one layer type, which variables a style splits and on
which axis, which axis of the input and output is split, and how a rank
computes its part with `keras.ops` and the collective adapter. The math is
written on local (per-rank) tensors only, so it is the same for every
backend; the runtimes decide how the local tensors come to exist.
"""

import numpy as np
from keras import ops

from keras_tp.keras_internals import stored_kernel
from keras_tp.plan.styles import Column


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
