"""A compiled Keras model: its loss, metrics and compile arguments."""

import contextlib
import logging

import keras
from keras.src.losses.losses import LossFunctionWrapper
from keras.src.utils.io_utils import print_msg

logger = logging.getLogger(__name__)

__all__ = ["print_msg"]


class BuildsBeforeTracing:
    """Model mixin: on TensorFlow, compiled metrics and a compiled loss of
    several outputs are built before the first step is traced, as on JAX
    and torch.

    Keras' TensorFlow trainer builds them symbolically only under a
    `tf.distribute` strategy, and otherwise inside the first traced step.
    A variable made while `tf.function` traces (a metric's total and
    count, the mean tracker of each output's loss) makes it trace the
    whole step again, which for a step that runs every replica's forward
    and backward pass doubles the cost of the first step. Building costs a
    symbolic forward pass, which only such variables repay: a single
    output's loss makes none.

    Every symbolic build (`evaluate()` before `fit()` too) builds the
    optimizer the model's own way (`_build_optimizer`), not on all of
    Keras' trainable variables: a pipeline stage's holds its own.
    """

    def _symbolic_build(self, iterator=None, data_batch=None):
        self._build_optimizer()
        super()._symbolic_build(iterator=iterator, data_batch=data_batch)

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        metrics = self._compile_metrics
        unbuilt_metrics = metrics is not None and not metrics.built
        if not (unbuilt_metrics or self._tracks_several_losses()):
            return
        try:
            self._symbolic_build(iterator=iterator, data_batch=data_batch)
        except Exception as error:
            # Building early only saves a trace; the step builds whatever
            # is left, and reports a real error with its own context.
            logger.debug("Building before the first step failed: %s", error)

    def _tracks_several_losses(self):
        """Whether the unbuilt compiled loss will track each output's
        loss: a loss per output, or one loss for a model of several."""
        loss = self._compile_loss
        if loss is None or loss.built:
            return False
        if keras.tree.is_nested(loss._user_loss):
            return len(keras.tree.flatten(loss._user_loss)) > 1
        # The wrapped model's outputs; a subclassed model's are unknown.
        outputs = getattr(self.model, "outputs", None) or []
        return len(keras.tree.flatten(outputs)) > 1


def overrides_compute_loss(model):
    """Whether `model`'s class computes its loss its own way."""
    return type(model).compute_loss is not keras.Model.compute_loss


class RunsModelsOwnLoss:
    """Model mixin: the loss is the wrapped model's own `compute_loss`
    where its class defines one (keras-hub's SigLIP, BASNet, RetinaNet,
    PARSeq and D-FINE do), with the wrapper's compiled loss.

    Such a method may call the model or its layers again (SigLIP's calls
    `self(x)`); they run split, as the wrapper's forward pass does. Its
    `super().compute_loss` reads the wrapped model's compiled loss, which
    is the wrapper's while the method runs.
    """

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        model = self.model
        if not overrides_compute_loss(model):
            return super().compute_loss(x, y, y_pred, sample_weight, training)
        own_loss = model._compile_loss
        model._compile_loss = self._compile_loss
        try:
            return model._compute_loss(
                x=x,
                y=y,
                y_pred=y_pred,
                sample_weight=sample_weight,
                training=training,
            )
        finally:
            model._compile_loss = own_loss


def compiled_user_losses(model):
    """The losses given to `model.compile` (strings, functions or `Loss`
    objects), flattened; empty when it has no compiled loss."""
    compiled = getattr(model, "_compile_loss", None)
    if compiled is None:
        return []
    return [loss for loss in keras.tree.flatten(compiled._user_loss) if loss]


def wrapped_loss_function(loss):
    """The function a `Loss` object applies to each sample, where it wraps
    one (as each of Keras' own loss classes does); else `None`."""
    return loss.fn if isinstance(loss, LossFunctionWrapper) else None


def compute_loss(model, **kwargs):
    """`model.compute_loss`, also when a user's override lacks `training`."""
    return model._compute_loss(**kwargs)


def compile_arguments(model):
    """The arguments by name that a compiled `model` last passed to Keras'
    own `compile`: a keras-hub task's, with its "auto" defaults filled
    in."""
    return dict(model._compile_config.config)


def compiled_loss(model):
    """The loss `compile(loss=...)` made, a function of `(y_true, y_pred)`
    (with an optional sample weight); `None` before compiling."""
    return model._compile_loss


def jax_update_metrics(model, metrics, loss, x, y, y_pred, sample_weight):
    """Keras' JAX trainer's metric update of a step, as values.

    Returns:
        `(logs, new values of model.metrics_variables)`.
    """
    return model._update_metrics_variables(
        metrics, loss, x, y, y_pred, sample_weight
    )


@contextlib.contextmanager
def losses_override(model, losses):
    """Inside, `model.losses` (which Keras' `compute_loss` adds) is
    `losses`."""
    model._losses_override = list(losses)
    try:
        yield
    finally:
        model._losses_override = []


def map_added_losses(model, fn):
    """Replaces each loss the layers of `model` added in an eager call
    (`add_loss`, kept on the layers until the next) by `fn` of it."""
    for layer in model._flatten_layers(include_self=True):
        layer._losses[:] = [fn(loss) for loss in layer._losses]


def update_loss_tracker(model, loss, sample_weight):
    """Adds a step's loss to the mean loss `fit()` reports."""
    model._loss_tracker.update_state(loss, sample_weight=sample_weight)


def tracked_loss(model, x, y, y_pred, sample_weight, training, batch_size):
    """A batch's loss, computed as Keras computes it and added (weighted by
    `batch_size`) to the mean loss `fit()` reports."""
    loss = compute_loss(
        model,
        x=x,
        y=y,
        y_pred=y_pred,
        sample_weight=sample_weight,
        training=training,
    )
    update_loss_tracker(model, loss, batch_size)
    return loss


def input_structure(model):
    """The symbolic inputs a Functional model was built on, in the
    structure its `call` takes (a dict, a list, one tensor); `None` for a
    model of another kind."""
    return getattr(model, "_inputs_struct", None)


def build_shapes(model):
    """`{argument name: shape}` that `model.build` was called with, or
    `None` for a model built otherwise."""
    return getattr(model, "_build_shapes_dict", None)


def loss_function_arguments(loss):
    """The keyword arguments a `LossFunctionWrapper` passes its function
    (`from_logits`, `ignore_class`, ...); `{}` for another loss."""
    return dict(getattr(loss, "_fn_kwargs", {}))


def metric_function(metric):
    """The function of `(y_true, y_pred)` a `MeanMetricWrapper` averages."""
    return metric._fn


def set_metric_function(metric, function):
    """Makes `metric` (a `MeanMetricWrapper`) average `function`'s values."""
    metric._fn = function


def attach_trainer_state(model):
    """Puts the values Keras' JAX trainer holds apart mid-`fit()` back
    into `model`'s variables, as a Keras callback's `self.model` does.

    In the middle of an epoch the JAX trainer keeps the step's state in
    arrays of its own and leaves the variables without values; code that
    reads them from a callback (the stats' conditions, `get_weights`)
    must sync first. Other backends keep no such state.
    """
    sync = getattr(model, "jax_state_sync", None)
    if sync is not None:
        sync()


def set_initial_epoch(model, epoch):
    """Makes the running `fit()` of `model` continue at `epoch`, as Keras'
    `BackupAndRestore` does from `on_train_begin`."""
    model._initial_epoch = epoch
