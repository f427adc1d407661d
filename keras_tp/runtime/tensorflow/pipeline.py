"""Pipeline stages on TensorFlow: one traced step, each stage on its device.

`TensorFlowPipelineRuntime` runs `TensorParallelKeras(pipeline_parallel=P)`:
each stage's variables and optimizer slots live on the stage's device, and
Keras' steps, which Keras traces into a `tf.function`, run the stages with
a `TensorFlowPipeline`.

The runner issues each action of the schedule
(`keras_tp.pipeline.schedules`) under `tf.device` of its stage: a forward
pass records its own `GradientTape`, the matching backward pass asks that
tape for the stage's gradients and for the gradients of the tensors it
received, which go to the previous stage's device. Control dependencies
chain each stage's actions in the schedule's order, so a stage runs one
micro-batch at a time and a 1F1B order bounds the activations it holds;
TensorFlow's executor runs the actions of different stages at the same
time where the data allows.
"""

import contextlib

import keras
import tensorflow as tf

from keras_tp.collectives.base import nbytes
from keras_tp.keras_internals import set_stored_value
from keras_tp.keras_internals import stored_value
from keras_tp.keras_internals import update_loss_tracker
from keras_tp.pipeline import schedules
from keras_tp.pipeline.runner import ScheduledStages
from keras_tp.pipeline.runtime import PipelineRuntime
from keras_tp.runtime.tensorflow import devices as tf_devices


class TensorFlowPipeline(ScheduledStages):
    """The stages of a pipeline, each run on its own device.

    Its steps are plain Python that issues TensorFlow operations: call
    them inside a `tf.function` (Keras' traced step), where they are
    traced once, or eagerly.

    Args: those of `ScheduledStages`; `devices` are TensorFlow device names.

    Attributes:
        peak_activations: after a training step was traced, per stage, the
            most micro-batches whose activations it held at once.
    """

    def __init__(
        self, stage_models, devices, loss, schedule, num_microbatches, stats
    ):
        super().__init__(
            stage_models, devices, loss, schedule, num_microbatches, stats
        )
        self.peak_activations = []

    def step(self, x, y):
        """One batch's forward and backward passes.

        Args:
            x: the batch's inputs, of a known batch size.
            y: the batch's targets.

        Returns:
            `(loss, gradients, y_pred)`: the batch's mean loss, each
            stage's gradients of it (summed over the micro-batches, dense)
            and the last stage's outputs of the whole batch.
        """
        count = self.num_microbatches
        last = len(self.stage_models) - 1
        size = self._microbatch_size(x)
        targets = [_microbatch(y, m, size) for m in range(count)]
        received = {(0, m): _microbatch(x, m, size) for m in range(count)}
        predictions = [None] * count
        tapes, results, cotangents = {}, {}, {}
        gradients = [None] * len(self.stage_models)
        previous = [[] for _ in self.stage_models]
        in_flight = [0] * len(self.stage_models)
        self.peak_activations = [0] * len(self.stage_models)
        loss = 0.0
        for stage, kind, m in self.order:
            model = self.stage_models[stage]
            with (
                tf.device(self.devices[stage]),
                tf.control_dependencies(previous[stage]),
            ):
                if kind == schedules.FORWARD:
                    in_flight[stage] += 1
                    self.peak_activations[stage] = max(
                        self.peak_activations[stage], in_flight[stage]
                    )
                    received_inputs = tf.nest.map_structure(
                        tf.identity, received.pop((stage, m))
                    )
                    with tf.GradientTape() as tape:
                        tape.watch(_floating(received_inputs))
                        outputs = model(received_inputs, training=True)
                        if stage == last:
                            predictions[m] = outputs
                            outputs = self.loss(targets[m], outputs) / count
                    tapes[stage, m] = tape
                    results[stage, m] = (received_inputs, outputs)
                    previous[stage] = tf.nest.flatten(outputs)
                    if stage == last:
                        loss = loss + outputs
                        continue
                    self._send(outputs, "forward")
                    received[stage + 1, m] = outputs
                    continue
                in_flight[stage] -= 1
                received_inputs, outputs = results.pop((stage, m))
                variables = model.trainable_variables
                sources = [*variables, *_floating(received_inputs)]
                # Integer tensors (a carried padding mask) take no part:
                # gradients flow between the floating-point ones only.
                grads = tapes.pop((stage, m)).gradient(
                    outputs if stage == last else _floating(outputs),
                    sources if stage else variables,
                    output_gradients=(
                        None if stage == last else cotangents.pop((stage, m))
                    ),
                )
                previous[stage] = [g for g in grads if g is not None]
                stage_grads = [
                    tf.convert_to_tensor(g) for g in grads[: len(variables)]
                ]
                gradients[stage] = (
                    stage_grads
                    if gradients[stage] is None
                    else [a + b for a, b in zip(gradients[stage], stage_grads)]
                )
                if stage:
                    sent = grads[len(variables) :]
                    self._send(sent, "backward")
                    cotangents[stage - 1, m] = sent
        return loss, gradients, _concatenated(predictions)

    def forward(self, x, training=False):
        """The stages' outputs for a batch, one micro-batch after the other.

        Args:
            x: the batch's inputs, of a known batch size.
            training: the `training` argument of the stages' calls.

        Returns:
            The last stage's outputs of the whole batch.
        """
        size = self._microbatch_size(x)
        predictions = []
        for m in range(self.num_microbatches):
            outputs = _microbatch(x, m, size)
            for stage, model in enumerate(self.stage_models):
                if stage:
                    self._send(outputs, "forward")
                with tf.device(self.devices[stage]):
                    outputs = model(outputs, training=training)
            predictions.append(outputs)
        return _concatenated(predictions)

    def _microbatch_size(self, x):
        # Traced per input signature: the batch size is known here.
        batch = tf.nest.flatten(x)[0].shape[0]
        schedules.check_microbatches(batch, self.num_microbatches)
        return batch // self.num_microbatches

    def _send(self, tensors, direction):
        """Counts `tensors` as sent to a neighbouring stage."""
        for tensor in tf.nest.flatten(tensors):
            self.stats.record("send", nbytes(tensor), direction, "pipe")


class TensorFlowPipelineRuntime(PipelineRuntime):
    """`PipelineRuntime` on TensorFlow devices (GPUs or logical CPUs).

    Every variable of a stage, and every optimizer slot of such a variable,
    is a `tf.Variable` placed on the stage's device. Keras traces its
    train, test and predict steps into a `tf.function` once; the runtime's
    steps issue each stage's work there under its device (see
    `TensorFlowPipeline`), so the sends counted under axis `"pipe"` are
    those of one step.

    Args: those of `PipelineRuntime`.

    Attributes:
        peak_activations: after a training step was traced, per stage, the
            most micro-batches whose activations it held at once.
        last_num_microbatches: the micro-batch count of the last traced
            step, or `None` before any.
    """

    backend = "tensorflow"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # One runner per micro-batch count: a batch of another size may
        # take another count.
        self._runners = {}
        self.peak_activations = []
        self.last_num_microbatches = None

    def _available_devices(self):
        if tf_devices._MULTI_WORKER_STRATEGY is not None:
            raise NotImplementedError(
                "pipeline_parallel on TensorFlow runs its stages on the "
                "devices of one host: with configure_multi_worker(), use "
                "pipeline_parallel=1, or the torch backend."
            )
        return tf_devices.ReplicaDevices._available_devices(self)

    def _move(self, variable, stage):
        # A slot may be created while Keras traces a step: its storage
        # must outlive that trace.
        with tf.init_scope(), tf.device(self.devices[stage]):
            set_stored_value(
                variable,
                tf.Variable(
                    stored_value(variable).read_value(),
                    dtype=variable.dtype,
                    trainable=variable.trainable,
                    name=variable.name,
                ),
            )

    def device_bytes(self, variables):
        """`{device: bytes}` of these variables, read from where TensorFlow
        stores each."""
        totals = {device: 0 for device in self.devices}
        for variable in variables:
            device = tf_devices.device_name(stored_value(variable).device)
            totals[device] = totals.get(device, 0) + nbytes(variable)
        return totals

    def _runner(self, x):
        """The runner for the batch `x`, whose size picks the count."""
        batch = tf.nest.flatten(x)[0].shape[0]
        if batch is None:
            raise ValueError(
                "The batch size is unknown when Keras traces the step (a "
                "last batch smaller than the others, or a tf.data dataset "
                "batched without drop_remainder=True). pipeline_parallel "
                "on TensorFlow splits each batch into micro-batches when "
                "the step is traced: use a number of samples divisible by "
                "the batch size, or `dataset.batch(..., "
                "drop_remainder=True)`."
            )
        count = self.microbatches(batch)
        if count not in self._runners:
            self._runners[count] = TensorFlowPipeline(
                self.stage_models,
                self.devices,
                self._loss,
                self.schedule,
                count,
                self.stats,
            )
        self.last_num_microbatches = count
        return self._runners[count]

    def _loss(self, y_true, y_pred):
        # Read when a step is traced: `predict` needs no compiled loss,
        # and a model compiled again uses its new loss.
        return self.loss_function()(y_true, y_pred)

    def train_step(self, data):
        """Keras' train step, run as a pipeline.

        Args:
            data: the batch, `(x, y)`.

        Returns:
            The metrics' logs, as Keras' `train_step` returns them.
        """
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self.check_no_sample_weight(sample_weight)
        runner = self._runner(x)
        loss, gradients, y_pred = runner.step(x, y)
        self.peak_activations = list(runner.peak_activations)
        # One update of every stage's variables, so that the optimizer's
        # step counter advances once per batch.
        optimizer = self.trainer.optimizer
        with _updates_on_variable_devices(optimizer):
            optimizer.apply(
                [g for stage in gradients for g in stage],
                [
                    v
                    for model in self.stage_models
                    for v in model.trainable_variables
                ],
            )
        update_loss_tracker(self.trainer, loss, _batch_size(x))
        return self.trainer.compute_metrics(x, y, y_pred, None)

    def test_step(self, data):
        """Keras' test step: the stages' forward passes, the loss and the
        metrics.

        Args:
            data: the batch, `(x, y)`.

        Returns:
            The metrics' logs, as Keras' `test_step` returns them.
        """
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self.check_no_sample_weight(sample_weight)
        y_pred = self._runner(x).forward(x)
        loss = self._loss(y, y_pred)
        update_loss_tracker(self.trainer, loss, _batch_size(x))
        return self.trainer.compute_metrics(x, y, y_pred, None)

    def predict_step(self, data):
        """Keras' predict step: the stages' forward passes.

        Args:
            data: the batch, `x` or a tuple starting with it.

        Returns:
            The model's outputs of the batch.
        """
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        return self._runner(x).forward(x)


@contextlib.contextmanager
def _updates_on_variable_devices(optimizer):
    """Runs the update of each variable on the variable's device.

    TensorFlow puts a variable's reads and writes on its device, but the
    arithmetic of an update (Adam's moments) on the default device: the
    slots of every stage would cross to it and back.
    """
    update_step = optimizer.update_step

    def update_on_device(gradient, variable, learning_rate):
        with tf.device(variable.device):
            return update_step(gradient, variable, learning_rate)

    optimizer.update_step = update_on_device
    try:
        yield
    finally:
        del optimizer.update_step


def _microbatch(structure, m, size):
    """Micro-batch `m` (of `size` samples) of every tensor in `structure`."""
    return tf.nest.map_structure(
        lambda a: a[m * size : (m + 1) * size], structure
    )


def _concatenated(microbatches):
    """The micro-batches' structures put back together along the batch."""
    return tf.nest.map_structure(
        lambda *parts: tf.concat(parts, axis=0), *microbatches
    )


def _batch_size(x):
    return tf.shape(tf.nest.flatten(x)[0])[0]


def _floating(structure):
    """The floating-point tensors of `structure`, in `tf.nest` order (the
    same on both sides of a cut)."""
    return [t for t in tf.nest.flatten(structure) if t.dtype.is_floating]


PIPELINE_RUNTIME = TensorFlowPipelineRuntime
