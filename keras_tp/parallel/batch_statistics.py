"""Batch statistics of the global batch under data parallelism.

With a data axis each data-parallel row runs the forward pass on its part
of the global batch. A BatchNormalization layer in training normalises by
the batch's mean and variance; computed on a row's part alone, they
differ from one device's (torch DDP does so unless the model uses
`torch.nn.SyncBatchNorm`). Here each layer computes them over the global
batch, as one device does: the rows' sums are all-reduced over `data`,
the mean's first, then the squared deviations from it (two passes, as
Keras' `ops.moments` computes them). Each all-reduce's gradient is
all-reduced too (Megatron's `f` then `g`), so that a row's backward pass
takes every row's loss into account through the shared statistics.

Where the step runs on whole arrays (JAX without per-rank steps) the
batch is already global, and under local SGD (`local_sgd_steps`) each
replica trains apart, its statistics its own: there the layer runs
unchanged.
"""

import keras
from keras import ops

from keras_tp.keras_internals import batch_moments
from keras_tp.keras_internals import reduction_axes
from keras_tp.keras_internals import set_batch_moments
from keras_tp.keras_internals import sublayers

_HALF_FLOATS = ("float16", "bfloat16")


def install(model, runtime, trainer):
    """Makes `model`'s BatchNormalization layers normalise by the
    statistics of the global batch, where `runtime` has a data axis.

    Args:
        model: the wrapped model.
        runtime: its runtime.
        trainer: the `TensorParallelKeras` that trains it.
    """
    if runtime.data_parallel == 1:
        return
    for layer in sublayers(model):
        if isinstance(layer, keras.layers.BatchNormalization):
            set_batch_moments(layer, _global_moments(layer, runtime, trainer))


def _global_moments(layer, runtime, trainer):
    """`layer`'s `(mean, variance)` of a batch, over every data row."""
    local_moments = batch_moments(layer)

    def moments(inputs, mask):
        optimizer = getattr(trainer, "optimizer", None)
        trains_apart = getattr(optimizer, "local_sgd_steps", None)
        if trains_apart or not runtime.holds_local_values():
            return local_moments(inputs, mask)
        adapter = runtime.data_adapter
        axes = reduction_axes(layer)
        dtype = inputs.dtype
        if keras.backend.standardize_dtype(dtype) in _HALF_FLOATS:
            inputs = ops.cast(inputs, "float32")
        if mask is None:
            weights = None
            # Every row holds an equal part of the batch.
            count = ops.sum(ops.ones_like(inputs), axes, keepdims=True)
            count = count * adapter.size()
        else:
            weights = ops.broadcast_to(
                ops.cast(ops.expand_dims(mask, -1), inputs.dtype),
                ops.shape(inputs),
            )
            count = _summed(adapter, ops.sum(weights, axes, keepdims=True))
            count = count + keras.backend.epsilon()
        weighted = inputs if weights is None else inputs * weights
        mean = _summed(adapter, ops.sum(weighted, axes, keepdims=True))
        mean = mean / count
        deviations = ops.square(inputs - mean)
        if weights is not None:
            deviations = deviations * weights
        variance = _summed(adapter, ops.sum(deviations, axes, keepdims=True))
        variance = variance / count
        return (
            ops.cast(ops.squeeze(mean, axes), dtype),
            ops.cast(ops.squeeze(variance, axes), dtype),
        )

    return moments


def _summed(adapter, x):
    """`x` summed over the data rows, its gradient summed too."""
    return adapter.reduce_from_parallel(adapter.copy_to_parallel(x))
