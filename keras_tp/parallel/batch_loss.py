"""The loss of the global batch under data parallelism.

With a data axis each data-parallel row computes the loss of its part of
every batch, and the optimizer averages the rows' gradients. That is the
global batch's loss where the loss is a mean of per-sample values: one of
Keras' own losses, reduced `"sum_over_batch_size"` (the default) or
`"mean"`. Any other loss would differ from one device's, silently:

- a `"sum"` is the rows' sum, and the rows' mean is a fraction of it;
- `"mean_with_sample_weight"` divides by each row's weights;
- a loss that couples samples (SigLIP's and CLIP's contrastive losses,
  over every pair of the batch) would miss the pairs across rows.

Predictions that carry a Keras mask (an `Embedding(mask_zero=True)`'s)
differ too under Keras' own losses: their mean is over each row's unmasked
entries. Where they are one tensor, each row weighs its mean by its share
of unmasked entries over the rows' mean share (one float all-reduced over
`data`), and the rows' losses average to the global batch's. For the
others each row gathers every row's labels, predictions (with their
masks) and sample weights over `data` and computes the loss of the global
batch, as one device does (and as `keras.distribution.DataParallel`, on
global arrays, does). A row's predictions enter with their gradient
scaled by the rows' count, since the rows' gradients are averaged. A
model whose class computes its own loss (`compute_loss`) keeps its rows'
losses, with a warning: such a method may run the model again on its
inputs, and what it pairs is its own. Losses a layer adds in its call
(`add_loss`: a mixture-of-experts router's load-balancing loss) are each
row's, averaged over the rows, as DDP and Megatron compute them: where
such a loss is not a mean over samples it differs from one device's, and
keras_tp warns, naming the layers.
"""

import warnings
import weakref

import keras
from keras import ops

from keras_tp.keras_internals import adds_loss_in_call
from keras_tp.keras_internals import compiled_user_losses
from keras_tp.keras_internals import get_keras_mask
from keras_tp.keras_internals import overrides_compute_loss
from keras_tp.keras_internals import set_keras_mask
from keras_tp.keras_internals import sublayers
from keras_tp.keras_internals import wrapped_loss_function
from keras_tp.tensors import carried_masks

# Reductions whose means over parts of a batch (rows, micro-batches) of
# equal size average to the whole batch's.
MEAN_REDUCTIONS = ("sum_over_batch_size", "mean")


class GlobalBatchLoss:
    """Model mixin: the compiled loss is the global batch's where the
    rows' losses would not average to it (see the module docstring)."""

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        runtime = self._runtime
        compute = super().compute_loss
        if y_pred is not None and _rows_hold_their_own_samples(runtime):
            warn_of_added_losses(
                self.model, f"data_parallel={runtime.data_parallel}"
            )
            if overrides_compute_loss(self.model):
                warnings.warn(
                    f"{type(self.model).__name__}.compute_loss runs on each "
                    "data-parallel row's part of the batch (data_parallel="
                    f"{runtime.data_parallel}). Where it pairs samples (a "
                    "contrastive loss, as SigLIP's) or divides by counts "
                    "over the batch, its loss and gradients differ from one "
                    "device's: train it with data_parallel=1.",
                    stacklevel=2,
                )
            elif not _rows_mean_is_global(self, y_pred):
                if _averages_but_for_a_mask(self, y_pred):
                    sample_weight = _weighed_by_kept_share(
                        y_pred, sample_weight, runtime.data_adapter
                    )
                    return compute(x, y, y_pred, sample_weight, training)
                return _loss_of_all_rows(
                    compute,
                    runtime.data_adapter,
                    (x, y, y_pred, sample_weight),
                    training,
                )
        return compute(x, y, y_pred, sample_weight, training)


# `{model: [path, ...]}`: the layers whose call adds a loss, read from
# their source once per model (`compute_loss` runs every step on torch).
_LOSS_ADDING_LAYERS = weakref.WeakKeyDictionary()


def _loss_adding_layers(model):
    if model not in _LOSS_ADDING_LAYERS:
        _LOSS_ADDING_LAYERS[model] = [
            layer.path
            for layer in [model, *sublayers(model)]
            if adds_loss_in_call(layer)
        ]
    return _LOSS_ADDING_LAYERS[model]


def warn_of_added_losses(model, parts):
    """Warns where `model`'s layers add losses in their call, which each
    part of a batch split as `parts` says computes on its own samples."""
    paths = _loss_adding_layers(model)
    if paths:
        warnings.warn(
            f"Layers {paths} add losses in their call (add_loss: a "
            "mixture-of-experts router's load-balancing loss, say). With "
            f"{parts} each part of the batch (a data-parallel row, a "
            "micro-batch) computes them on its own samples and the parts' "
            "values are averaged, as DDP and Megatron do; where such a loss "
            "is not a mean over samples it differs from one device's. Train "
            "with data_parallel=1 and num_microbatches=1 to match one "
            "device.",
            stacklevel=3,
        )


def adds_losses(model):
    """Whether calling `model` adds losses to the compiled one: a weight's
    or a layer output's regularizer, a layer's `add_loss` in its `call`,
    or a loss its last run added."""
    layers = [model, *sublayers(model)]
    return (
        bool(model.losses)
        or any(layer.activity_regularizer is not None for layer in layers)
        or bool(_loss_adding_layers(model))
    )


def _averages_but_for_a_mask(trainer, y_pred):
    """Whether the predictions are one tensor carrying a Keras mask, and
    each compiled loss a mean of Keras' per-sample values."""
    return len(keras.tree.flatten(y_pred)) == 1 and all(
        averages_over_rows(loss) for loss in compiled_user_losses(trainer)
    )


def _weighed_by_kept_share(y_pred, sample_weight, adapter):
    """`sample_weight` (ones where `None`) times this row's share of
    unmasked entries over the rows' mean share (one float all-reduced
    over `data`): each row's masked mean, over its own unmasked entries,
    weighed so, averages to the global batch's (see `kept_fraction`)."""
    fraction = kept_fraction(y_pred, split=False)
    scale = fraction / adapter.all_reduce(fraction, "mean")
    if sample_weight is None:
        (mask,) = carried_masks(y_pred).values()
        return ops.full(ops.shape(mask), scale)
    return keras.tree.map_structure(lambda w: w * scale, sample_weight)


def _rows_mean_is_global(trainer, y_pred):
    """Whether the rows' mean of `trainer`'s compiled loss is the global
    batch's: each loss is a mean of Keras' per-sample values, and no
    prediction carries a mask."""
    if any(get_keras_mask(t) is not None for t in keras.tree.flatten(y_pred)):
        return False
    return all(
        averages_over_rows(loss) for loss in compiled_user_losses(trainer)
    )


def _loss_of_all_rows(compute, adapter, arguments, training):
    """`compute`'s loss of every data row's values, gathered by `adapter`
    from this row's `(x, y, y_pred, sample_weight)`."""
    x, y, y_pred, sample_weight = arguments
    rows = adapter.size()

    def every_row(tensor):
        return None if tensor is None else adapter.all_gather(tensor, 0)

    def every_prediction(tensor):
        # Value once, gradient `rows` times: the rows' are averaged.
        scaled = tensor * rows - ops.stop_gradient(tensor * (rows - 1))
        gathered = adapter.gather_from_parallel(scaled, axis=0)
        mask = get_keras_mask(tensor)
        if mask is not None:
            mask = every_row(ops.cast(mask, "int32"))
            set_keras_mask(gathered, ops.cast(mask, "bool"))
        return gathered

    return compute(
        x,
        keras.tree.map_structure(every_row, y),
        keras.tree.map_structure(every_prediction, y_pred),
        keras.tree.map_structure(every_row, sample_weight),
        training=training,
    )


def _rows_hold_their_own_samples(runtime):
    """Whether each data row's step computes the loss of its samples: a
    data axis, outside a pipeline (whose micro-batches
    `PipelineRuntime.check_compiled` judges), with per-rank values."""
    if runtime.config.pipeline_parallel > 1 or runtime.data_parallel == 1:
        return False
    return runtime.holds_local_values()


def averages_over_rows(loss):
    """Whether the rows' mean of `loss` (a name, function or `Loss`, as
    `compile` takes it) is the global batch's `loss`."""
    if isinstance(loss, str):
        return True
    if isinstance(loss, keras.losses.Loss):
        function = wrapped_loss_function(loss)
        return loss.reduction in MEAN_REDUCTIONS and _keras_own(function)
    return _keras_own(loss)


def _keras_own(function):
    return getattr(function, "__module__", "").startswith("keras.")


_MASKED_OUTPUTS = (
    "Several predictions carry Keras masks: each micro-batch's (and "
    "replica's) loss of each is the mean over its own unmasked entries, "
    "and the pipeline averages them. Where micro-batches hold different "
    "numbers of masked entries, the loss and its gradients differ from one "
    "device's; num_microbatches=1 and data_parallel=1 compute the batch's."
)


def kept_fraction(y_pred, split):
    """The share of entries the Keras mask of the predictions keeps, where
    they are one masked tensor; else `None` (with a warning where several
    carry masks, whose losses no one share scales, of a `split` batch).

    A masked loss of one part of a batch (a pipeline's micro-batch) is the
    mean over its unmasked entries: times this share, the parts' losses
    average to the batch's times the mean of their shares (see
    `fraction_scale`)."""
    masks = carried_masks(y_pred)
    if not masks:
        return None
    if len(keras.tree.flatten(y_pred)) > 1:
        if split:
            warnings.warn(_MASKED_OUTPUTS, stacklevel=3)
        return None
    (mask,) = masks.values()
    return keras.ops.mean(keras.ops.cast(mask, "float32"))


def fraction_scale(fractions):
    """What the micro-batches' (and replicas') averaged loss and gradients
    are multiplied by: 1 over the mean of their `fraction`s (see
    `PipelineRuntime.loss_function`); `None` where they have none."""
    if not fractions or fractions[0] is None:
        return None
    return 1.0 / keras.ops.mean(keras.ops.stack(fractions))
