"""Whole pipeline stages on TensorFlow: each stage on one device.

`TensorFlowPipelineRuntime` runs `TensorParallelKeras(pipeline_parallel=P,
data_parallel=D)`: `D` replicas of a `P`-stage pipeline, each training on
its slice of every batch. Each stage's variables and optimizer slots live
on the stage's device in the first replica; every other replica holds a
mirror of the stage's variables on its own device (`MirroredStage`).
Keras' steps, which Keras traces into a `tf.function`, run each replica's
stages with a `TensorFlowPipeline`.

The runner issues each action of the schedule
(`keras_tp.pipeline.schedules`) under `tf.device` of its stage: a forward
pass records its own `GradientTape`, the matching backward pass asks that
tape for the stage's gradients and for the gradients of the tensors it
received, which go to the previous stage's device. Control dependencies
chain each stage's actions in the schedule's order, so a stage runs one
micro-batch at a time and a 1F1B order bounds the activations it holds;
TensorFlow's executor runs the actions of different stages, and of
different replicas, at the same time where the data allows. With
replicas, each stage's gradients are then averaged on the first replica's
device of the stage, the optimizer updates the first replica's variables,
and their new values are copied to the mirrors.
"""

import contextlib

import keras
import tensorflow as tf

from keras_tp.collectives.base import nbytes
from keras_tp.keras_internals import seed_generators
from keras_tp.keras_internals import set_stored_value
from keras_tp.keras_internals import shifted_seed_draws
from keras_tp.keras_internals import stored_value
from keras_tp.keras_internals import update_loss_tracker
from keras_tp.pipeline import schedules
from keras_tp.pipeline.runner import ScheduledStages
from keras_tp.pipeline.runtime import PipelineRuntime
from keras_tp.regions import RANK_SEED_STRIDE
from keras_tp.runtime.tensorflow import devices as tf_devices


class MirroredStage:
    """A stage of a replica other than the first: the stage's layers on
    mirrors of its variables, on the replica's own device.

    The first replica runs the stage's Keras model, whose variables the
    optimizer updates. A mirror holds a copy of each of the model's
    variables, a `tf.Variable` on `device`, and runs the model's own
    layers on them with `stateless_call`. It is called as the model is,
    so a `TensorFlowPipeline` runs either.

    Args:
        model: the stage's Keras model, whose variables it mirrors.
        device: the TensorFlow device of this replica's stage.
        replica: the replica's index (1 and up): its random draws (a
            dropout's masks) move to a stream of their own, as the
            replicas of a data-parallel step draw their own masks.

    Attributes:
        trainable_variables: the mirrors of `model.trainable_variables`,
            in that order.
        non_trainable_variables: the mirrors of
            `model.non_trainable_variables` (frozen statistics, the state
            of seed generators), in that order.
    """

    def __init__(self, model, device, replica):
        self.model = model
        self.device = device
        self.replica = replica
        self.generators = seed_generators(model)
        # Made outside any trace: the mirrors live as long as the runtime.
        with tf.init_scope(), tf.device(device):
            self.trainable_variables = [
                _mirror(v) for v in model.trainable_variables
            ]
            self.non_trainable_variables = [
                _mirror(v) for v in model.non_trainable_variables
            ]

    def mirrors(self):
        """`(Keras variable, its mirror)` pairs of every variable."""
        return [
            *zip(self.model.trainable_variables, self.trainable_variables),
            *zip(
                self.model.non_trainable_variables,
                self.non_trainable_variables,
            ),
        ]

    def __call__(self, inputs, training=False):
        """The stage's outputs of `inputs`, computed with the mirrors.

        Args:
            inputs: the stage model's inputs.
            training: the `training` argument of the layers' calls.

        Returns:
            The stage model's outputs.
        """
        with shifted_seed_draws(
            self.generators, lambda: self.replica * RANK_SEED_STRIDE
        ):
            outputs, values = self.model.stateless_call(
                self.trainable_variables,
                self.non_trainable_variables,
                inputs,
                training=training,
            )
        # State a layer updates as it runs (a seed generator drawing a
        # dropout mask) is this replica's own: it stays in its mirror.
        for mirror, value in zip(self.non_trainable_variables, values):
            if value is not mirror:
                mirror.assign(value)
        return outputs


class TensorFlowPipeline(ScheduledStages):
    """The stages of a pipeline, each run on its own device.

    Its steps are plain Python that issues TensorFlow operations: call
    them inside a `tf.function` (Keras' traced step), where they are
    traced once, or eagerly.

    Args: those of `ScheduledStages`; `devices` are TensorFlow device
        names, and each of `stage_models` is the stage's Keras model or,
        in a replica other than the first, its `MirroredStage`.
        borrowed_bytes: per stage, the bytes of the weights it reads
            from an earlier stage's device (a tied embedding): each of
            its forward passes copies them over, and they are counted as
            sent on `"pipe"`. `None`: none.

    Attributes:
        peak_activations: after a training step was traced, per stage, the
            most micro-batches whose activations it held at once.
        gradients: after a training step was traced, each stage's
            gradients of its trainable variables, summed over the
            micro-batches (`_accumulate`).
    """

    def __init__(
        self,
        stage_models,
        devices,
        loss,
        schedule,
        num_microbatches,
        stats,
        borrowed_bytes=None,
    ):
        super().__init__(
            stage_models, devices, loss, schedule, num_microbatches, stats
        )
        self.borrowed_bytes = borrowed_bytes or [0] * len(stage_models)
        self.peak_activations = []

    def step(self, x, y):
        """One batch's forward and backward passes.

        Args:
            x: the batch's inputs, of a known batch size.
            y: the batch's targets.

        Returns:
            `(loss, y_pred)`: the batch's mean loss and the last stage's
            outputs of the whole batch. `gradients` then holds each
            stage's gradients of the loss (see `_accumulate`).
        """
        count = self.num_microbatches
        last = len(self.stage_models) - 1
        received, targets = self._microbatches(x, y)
        predictions = [None] * count
        cotangents = {}
        previous = [[] for _ in self.stage_models]
        in_flight = [0] * len(self.stage_models)
        self.peak_activations = [0] * len(self.stage_models)
        self._tapes = {}
        self.gradients = {}
        losses = []
        self.times = []
        ends = {}
        for stage, kind, m in self.order:
            if kind == schedules.FORWARD:
                inputs = received[stage, m]
                sender = (stage - 1, kind, m)
            else:
                inputs = cotangents.get((stage, m), [])
                sender = (stage + 1, kind, m)
            with (
                tf.device(self.devices[stage]),
                tf.control_dependencies(previous[stage]),
                self._timed(inputs, ends.get(sender)),
            ):
                if kind == schedules.FORWARD:
                    in_flight[stage] += 1
                    self.peak_activations[stage] = max(
                        self.peak_activations[stage], in_flight[stage]
                    )
                    outputs, predicted = self._run_forward(
                        stage,
                        m,
                        received.pop((stage, m)),
                        targets[m] if stage == last else None,
                    )
                    previous[stage] = tf.nest.flatten(outputs)
                    ends[stage, kind, m] = self._ended(previous[stage])
                    if stage == last:
                        losses.append(outputs)
                        predictions[m] = predicted
                        continue
                    self._send(outputs, "forward")
                    received[stage + 1, m] = outputs
                    continue
                in_flight[stage] -= 1
                sent, previous[stage] = self._run_backward(
                    stage, m, cotangents.pop((stage, m), None)
                )
                ends[stage, kind, m] = self._ended(previous[stage])
                if stage:
                    self._send(sent, "backward")
                    cotangents[stage - 1, m] = sent
        return self._joined(losses, predictions)

    def _microbatches(self, x, y):
        """`(received, targets)`: the first stage's input of each
        micro-batch, by `(0, m)`, and the last stage's targets, by `m`."""
        size = self._microbatch_size(x)
        count = self.num_microbatches
        received = {(0, m): batch_part(x, m, size) for m in range(count)}
        return received, [batch_part(y, m, size) for m in range(count)]

    def _run_forward(self, stage, m, received, target):
        """Micro-batch `m`'s forward pass of `stage`, on its tape.

        Args:
            stage: the stage's index.
            m: the micro-batch's index.
            received: the stage's inputs.
            target: the targets, for the last stage; else `None`.

        Returns:
            `(outputs, predicted)`: what the stage sends on, or, for the
            last stage, its share of the batch's loss, with the stage's
            outputs.
        """
        received = tf.nest.map_structure(tf.identity, received)
        self._borrow(stage)
        predicted = None
        with tf.GradientTape() as tape:
            tape.watch(floating(received))
            outputs = self.stage_models[stage](received, training=True)
            if target is not None:
                predicted = outputs
                outputs = self.loss(target, outputs) / self.num_microbatches
        self._tapes[stage, m] = (tape, received, outputs)
        return outputs, predicted

    def _run_backward(self, stage, m, cotangent):
        """Micro-batch `m`'s backward pass of `stage`.

        Args:
            stage: the stage's index.
            m: the micro-batch's index.
            cotangent: the gradients of the stage's floating-point outputs
                (`None` for the last stage, which computed the loss).

        Returns:
            `(sent, done)`: the gradients of the stage's floating-point
            inputs, for the previous stage, and the tensors the pass ends
            with.
        """
        tape, received, outputs = self._tapes.pop((stage, m))
        variables = self.stage_models[stage].trainable_variables
        # Integer tensors (a carried padding mask) take no part: gradients
        # flow between the floating-point ones only.
        grads = tape.gradient(
            outputs if cotangent is None else floating(outputs),
            [*variables, *floating(received)] if stage else variables,
            output_gradients=cotangent,
        )
        self._accumulate(stage, variables, grads[: len(variables)])
        return grads[len(variables) :], [g for g in grads if g is not None]

    def _accumulate(self, stage, variables, grads, key=None):
        """Adds a micro-batch's gradients to `gradients[key or stage]`: per
        trainable variable of the stage, dense, summed over micro-batches.

        A stage may hold a weight it does not read: a layer called in
        several stages (keras-hub's ReversibleEmbedding with untied logits)
        has all its weights in each; its gradient is zero.
        """
        key = stage if key is None else key
        dense = [
            tf.zeros_like(v) if g is None else tf.convert_to_tensor(g)
            for v, g in zip(variables, grads)
        ]
        total = self.gradients.get(key)
        self.gradients[key] = (
            dense if total is None else [a + b for a, b in zip(total, dense)]
        )

    def _joined(self, losses, predictions):
        """`(loss, y_pred)` of the batch from each micro-batch's."""
        return tf.add_n(losses), concatenated(predictions)

    @contextlib.contextmanager
    def _timed(self, inputs, sent=None):
        """Times the action issued inside, on its stage's device.

        Its start is a `tf.timestamp` that runs once the action's inputs,
        the timestamp `sent` of the end of the action that sent them, and
        its stage's previous action are done; the action's operations wait
        for it. `_ended` adds the timestamp of its end. So the times are
        the executor's, as the step runs, not the trace's.
        """
        waits = tf.nest.flatten(inputs) + ([sent] if sent is not None else [])
        with tf.control_dependencies(waits):
            start = tf.timestamp()
        self.times.append([start])
        with tf.control_dependencies([start]):
            yield

    def _ended(self, outputs):
        """The timestamp of the end of the action timed last."""
        with tf.control_dependencies(outputs):
            end = tf.timestamp()
        self.times[-1].append(end)
        return end

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
            outputs = batch_part(x, m, size)
            for stage, model in enumerate(self.stage_models):
                if stage:
                    self._send(outputs, "forward")
                self._borrow(stage)
                with tf.device(self.devices[stage]):
                    outputs = model(outputs, training=training)
            predictions.append(outputs)
        return concatenated(predictions)

    def _microbatch_size(self, x):
        # Traced per input signature: the batch size is known here.
        batch = tf.nest.flatten(x)[0].shape[0]
        schedules.check_microbatches(batch, self.num_microbatches)
        return batch // self.num_microbatches

    def _borrow(self, stage):
        """Counts the weights a forward pass of `stage` reads from an
        earlier stage's device."""
        if self.borrowed_bytes[stage]:
            self.stats.record(
                "send", self.borrowed_bytes[stage], "forward", "pipe"
            )

    def _send(self, tensors, direction):
        """Counts `tensors` as sent to a neighbouring stage."""
        for tensor in tf.nest.flatten(tensors):
            self.stats.record("send", nbytes(tensor), direction, "pipe")


class TensorFlowPipelineRuntime(PipelineRuntime):
    """`PipelineRuntime` on TensorFlow devices (GPUs or logical CPUs).

    The devices form a `data x pipe` grid: stage `s` of replica `d` runs on
    `stage_devices[s][d]`. Every variable of a stage, and every optimizer
    slot of such a variable, is a `tf.Variable` placed on the stage's
    device in the first replica; every other replica holds a mirror of
    the stage's variables on its own device (`MirroredStage`), and no
    optimizer slots. Keras traces its train, test and predict steps into
    a `tf.function` once; the runtime's steps issue each replica's stages
    there under their devices (see `TensorFlowPipeline`), each replica on
    its slice of the batch, so the sends counted under axis `"pipe"` and
    the copies counted under axis `"data"` are those of one step.

    Args: those of `PipelineRuntime`; `world_size` is `pipeline_parallel x
        data_parallel` (stages split by tensor parallelism, or whose
        optimizer state ZeRO partitions, run as `SplitStagesRuntime`).

    Attributes:
        peak_activations: after a training step was traced, per stage, the
            most micro-batches whose activations it held at once (in each
            replica).
        last_num_microbatches: the micro-batch count of the last traced
            step, or `None` before any.
    """

    backend = "tensorflow"
    # A weight several stages use stays on its first stage's device, and
    # the later stages read it there (`_owned_gradients`).
    shares_weights = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # One list of runners (one per replica) per micro-batch count: a
        # batch of another size may take another count.
        self._runners = {}
        # Per micro-batch count, the start and end times of each action of
        # the first replica's last training step, in the schedule's order.
        self._step_times = {}
        self._trained_count = None
        # Per replica, each stage as it runs there: the Keras models in
        # the first, their `MirroredStage`s (made by `prepare_model`) in
        # the others.
        self._replica_stages = [self.stage_models]
        # The mirrors of each stage variable, by id, in replica order.
        self._mirrors = {}
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

    def prepare_model(self, model):
        """Mirrors each stage's variables, once placed, on the stage's
        device in every replica but the first."""
        self._replica_stages = [self.stage_models] + [
            [
                MirroredStage(
                    stage_model, self.stage_devices[stage][replica], replica
                )
                for stage, stage_model in enumerate(self.stage_models)
            ]
            for replica in range(1, self.data_parallel)
        ]
        for replica in self._replica_stages[1:]:
            for stage in replica:
                for variable, mirror in stage.mirrors():
                    self._mirrors.setdefault(id(variable), []).append(mirror)

    def _move(self, variable, stage):
        # A slot may be created while Keras traces a step: its storage
        # must outlive that trace.
        with tf.init_scope(), tf.device(self.stage_devices[stage][0]):
            set_stored_value(
                variable,
                tf.Variable(
                    stored_value(variable).read_value(),
                    dtype=variable.dtype,
                    trainable=variable.trainable,
                    name=variable.name,
                ),
            )

    def assign_full_value(self, variable, value):
        """Assigns `value` to a variable and to its mirrors.

        Args:
            variable: a variable of the model (or an optimizer slot).
            value: its new, unsplit value.
        """
        variable.assign(value)
        for mirror in self._mirrors.get(id(variable), []):
            mirror.assign(value)

    def local_pieces(self, variable):
        """The whole variable, from its stage's device in the first
        replica (the mirrors hold copies)."""
        stored = stored_value(variable)
        device = tf_devices.device_name(stored.device).replace(":", "")
        whole = tuple((0, int(size)) for size in variable.shape)
        return [(device, whole, stored.numpy())]

    def assign_local_pieces(self, variable, read):
        self.assign_full_value(
            variable, read(tuple((0, int(size)) for size in variable.shape))
        )

    def device_bytes(self, variables):
        """`{device: bytes}` of these variables and of their mirrors, read
        from where TensorFlow stores each."""
        totals = {device: 0 for device in self.devices}
        for variable in variables:
            mirrors = self._mirrors.get(id(variable), [])
            for stored in [stored_value(variable), *mirrors]:
                device = tf_devices.device_name(stored.device)
                totals[device] = totals.get(device, 0) + nbytes(stored)
        return totals

    def _runners_of(self, x):
        """The replicas' runners for the batch `x`, each running its
        replica's slice; the slice's size picks the micro-batch count."""
        batch = traced_batch_size(x)
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
        self.check_batch_size(batch)
        count = self.microbatches(batch // self.data_parallel)
        if count not in self._runners:
            self._runners[count] = self._make_runners(count)
            with tf.init_scope():
                self._step_times[count] = tf.Variable(
                    tf.zeros(
                        (len(self._runners[count][0].order), 2), "float64"
                    ),
                    trainable=False,
                )
        self.last_num_microbatches = count
        return self._runners[count]

    def _make_runners(self, count):
        """The replicas' runners of `count` micro-batches."""
        return [
            TensorFlowPipeline(
                stages,
                [devices[replica] for devices in self.stage_devices],
                self._loss,
                self.schedule,
                count,
                self.stats,
                # The other replicas' mirrors hold each stage's copy.
                self._borrowed_bytes() if replica == 0 else None,
            )
            for replica, stages in enumerate(self._replica_stages)
        ]

    def _record_step(self, runner):
        """Keeps what `runner` (the first replica's) measured of the
        training step just traced: its peak activations, and the times its
        stages ran each action, which the step writes."""
        self.peak_activations = list(runner.peak_activations)
        self._trained_count = self.last_num_microbatches
        self._step_times[self._trained_count].assign(
            tf.stack([tf.stack(pair) for pair in runner.times])
        )

    def _loss(self, y_true, y_pred):
        # Read when a step is traced: `predict` needs no compiled loss,
        # and a model compiled again uses its new loss.
        return self.loss_function()(y_true, y_pred)

    def train_step(self, data):
        """Keras' train step, run as a pipeline in each replica.

        Args:
            data: the batch, `(x, y)`.

        Returns:
            The metrics' logs, as Keras' `train_step` returns them.
        """
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self.check_no_sample_weight(sample_weight)
        runners = self._runners_of(x)
        size = traced_batch_size(x) // self.data_parallel
        losses, replica_gradients, predictions = [], [], []
        for replica, runner in enumerate(runners):
            loss, y_pred = runner.step(
                batch_part(x, replica, size), batch_part(y, replica, size)
            )
            losses.append(loss)
            replica_gradients.append(
                [runner.gradients[s] for s in range(self.pipeline_parallel)]
            )
            predictions.append(y_pred)
        self._record_step(runners[0])
        gradients, variables = self._owned_gradients(
            self._averaged_gradients(replica_gradients)
        )
        # One update of every stage's variables, so that the optimizer's
        # step counter advances once per batch.
        optimizer = self.trainer.optimizer
        with _updates_on_variable_devices(optimizer):
            optimizer.apply(gradients, variables)
        self._copy_to_mirrors()
        # Each replica's loss is the mean over its equal slice.
        loss = tf.add_n(losses) / self.data_parallel
        update_loss_tracker(self.trainer, loss, traced_batch_size(x))
        return self.trainer.compute_metrics(
            x, y, concatenated(predictions), None
        )

    def measured_timeline(self):
        """The last training step's `schedules.Timeline`, from the times
        its first replica's stages ran each action (see
        `TensorFlowPipeline._timed`), or `None` before the first step."""
        if self._trained_count is None:
            return None
        order = self._runners[self._trained_count][0].order
        records = [[] for _ in range(self.pipeline_parallel)]
        times = self._step_times[self._trained_count].numpy()
        for (stage, kind, m), (start, end) in zip(order, times):
            records[stage].append((kind, m, float(start), float(end)))
        return schedules.recorded_timeline(records)

    def _averaged_gradients(self, replica_gradients):
        """Each stage's gradients averaged over the replicas.

        Each replica's gradients are the mean over its slice of the batch,
        and the slices are equal, so their mean is the whole batch's. The
        other replicas' gradients are copied to the first replica's device
        of the stage, which adds them up: `data_parallel - 1` copies of the
        stage's gradients, counted on axis `"data"`.

        Args:
            replica_gradients: per replica, per stage, the gradients of
                the stage's trainable variables.

        Returns:
            Per stage, the averaged gradients, on the first replica's
            device of the stage.
        """
        if self.data_parallel == 1:
            return replica_gradients[0]
        averaged = []
        for stage, devices in enumerate(self.stage_devices):
            with tf.device(devices[0]):
                per_variable = zip(
                    *(gradients[stage] for gradients in replica_gradients)
                )
                averaged.append(
                    [self._mean_on_first(copies) for copies in per_variable]
                )
        return averaged

    def _borrowed_bytes(self):
        """Per stage, the bytes of the weights it reads from the device of
        the earlier stage that owns them."""
        return [
            sum(
                nbytes(v.value)
                for v in model.weights
                if self.stage_of[id(v)] != stage
            )
            for stage, model in enumerate(self.stage_models)
        ]

    def _owned_gradients(self, gradients):
        """`(gradients, variables)`: every stage's trainable variables,
        each once, with its gradient. A weight several stages use (a tied
        embedding) lives on its first stage's device, which the others
        read it from; their gradients of it cross to that device and are
        added there (counted on `"pipe"`), as Megatron-LM all-reduces its
        word embeddings' gradients between its first and last stages.

        Args:
            gradients: per stage, the gradients of its trainable
                variables, on the stage's device.
        """
        totals = {}
        variables = []
        for model, grads in zip(self.stage_models, gradients):
            for variable, grad in zip(model.trainable_variables, grads):
                if id(variable) not in totals:
                    totals[id(variable)] = grad
                    variables.append(variable)
                    continue
                owner = self.stage_devices[self.stage_of[id(variable)]][0]
                with tf.device(owner):
                    totals[id(variable)] = totals[id(variable)] + grad
                self.stats.record("send", nbytes(grad), "backward", "pipe")
        return [totals[id(v)] for v in variables], variables

    def _mean_on_first(self, copies):
        """The mean of one gradient's copies, one per replica; traced under
        the first replica's device, to which the others cross."""
        for crossing in copies[1:]:
            self.stats.record("reduce", nbytes(crossing), "optimizer", "data")
        return tf.add_n(copies) / len(copies)

    def _copy_to_mirrors(self):
        """Copies each stage's updated variables to their mirrors, on the
        other replicas' devices: `data_parallel - 1` copies of the stage's
        trainable variables, counted on axis `"data"`.

        Traced after the optimizer's update, which TensorFlow's automatic
        control dependencies order before the reads of the same variables.
        """
        for replica in self._replica_stages[1:]:
            for stage in replica:
                with tf.device(stage.device):
                    for variable, mirror in zip(
                        stage.model.trainable_variables,
                        stage.trainable_variables,
                    ):
                        mirror.assign(variable.value)
                        self.stats.record(
                            "broadcast", nbytes(mirror), "optimizer", "data"
                        )

    def _forward(self, x):
        """Each replica's stages' outputs of its slice of `x`, put back
        together in batch order."""
        runners = self._runners_of(x)
        size = traced_batch_size(x) // self.data_parallel
        return concatenated(
            [
                runner.forward(batch_part(x, replica, size))
                for replica, runner in enumerate(runners)
            ]
        )

    def test_step(self, data):
        """Keras' test step: each replica's stages' forward passes of its
        slice, then the loss and the metrics of the whole batch.

        Args:
            data: the batch, `(x, y)`.

        Returns:
            The metrics' logs, as Keras' `test_step` returns them.
        """
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self.check_no_sample_weight(sample_weight)
        y_pred = self._forward(x)
        loss = self._loss(y, y_pred)
        update_loss_tracker(self.trainer, loss, traced_batch_size(x))
        return self.trainer.compute_metrics(x, y, y_pred, None)

    def predict_step(self, data):
        """Keras' predict step: each replica's stages' forward passes of
        its slice.

        Args:
            data: the batch, `x` or a tuple starting with it.

        Returns:
            The model's outputs of the batch, in its order.
        """
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        return self._forward(x)


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


def batch_part(structure, index, size):
    """Part `index` (of `size` samples) of every tensor in `structure`: a
    replica's slice of a batch, or a micro-batch of that slice."""
    return tf.nest.map_structure(
        lambda a: a[index * size : (index + 1) * size], structure
    )


def concatenated(parts):
    """The parts' structures put back together along the batch."""
    if len(parts) == 1:
        return parts[0]
    return tf.nest.map_structure(lambda *p: tf.concat(p, axis=0), *parts)


def traced_batch_size(x):
    """The batch size of `x` as traced: `None` where it is unknown."""
    return tf.nest.flatten(x)[0].shape[0]


def _mirror(variable):
    """A `tf.Variable` holding a copy of a Keras variable's value, on the
    current device."""
    return tf.Variable(
        variable.value,
        dtype=variable.dtype,
        trainable=variable.trainable,
        name=f"{variable.name}_mirror",
    )


def floating(structure):
    """The floating-point tensors of `structure`, in `tf.nest` order (the
    same on both sides of a cut)."""
    return [t for t in tf.nest.flatten(structure) if t.dtype.is_floating]
