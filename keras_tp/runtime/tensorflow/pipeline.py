"""Pipelines on TensorFlow: every stage a `tf.distribute` runtime of its
own, the schedule replica steps of the stages (`.stages`)."""

import contextlib

import keras
import tensorflow as tf

from keras_tp.collectives.tensorflow import ReplicaStats
from keras_tp.compiling import coordinated
from keras_tp.compiling import place_slots
from keras_tp.keras_internals import exclude_from_weight_decay
from keras_tp.keras_internals import mix_in
from keras_tp.keras_internals import mixed_class
from keras_tp.keras_internals import step_counter
from keras_tp.keras_internals import weight_decay_excluded
from keras_tp.parallel.clipping import global_norm_taken
from keras_tp.parallel.clipping import parts_factor
from keras_tp.parallel.clipping import takes_global_norm
from keras_tp.parallel.loss_scaling import loss_scale
from keras_tp.parallel.loss_scaling import next_scale
from keras_tp.parallel.loss_scaling import unscaled
from keras_tp.pipeline.runtime import PipelineRuntime
from keras_tp.runtime.tensorflow import TensorFlowRuntime
from keras_tp.runtime.tensorflow import devices as tf_devices
from keras_tp.runtime.tensorflow.optimizer import prepare_optimizer
from keras_tp.runtime.tensorflow.stage_storage import StageStorage
from keras_tp.runtime.tensorflow.stages import TensorFlowStages
from keras_tp.tensors import scaled


class TensorFlowPipelineRuntime(StageStorage, PipelineRuntime):
    """`PipelineRuntime` whose stages each run on a `TensorFlowRuntime` of
    their `data x model` devices, which stores the stage's variables, runs
    its split layers and updates them with a copy of the compiled
    optimizer."""

    backend = "tensorflow"
    # Each replica runs the code between the split layers on its own values.
    local_ranks = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Each replica of a stage issues its collectives: counted once.
        self.stats = ReplicaStats()
        self.stage_runtimes = self.stage_runtimes_of(TensorFlowRuntime)
        # Each stage's `_StageTrainer` (`build_optimizer`).
        self.stage_optimizers = []
        # The compiled optimizer the stage optimizers were made from.
        self._optimizers_of = None
        # By `(stage, id(variable))`, `(variable, copy)`: a later stage's
        # copy of a weight an earlier stage owns, on its replicas.
        self._copies = {}
        # The stage primitives per micro-batch count.
        self._stages = {}
        # The last training step's `(start, end)` of each action, made
        # here: a variable made in Keras' trace makes it trace again.
        self.step_times = tf.Variable(
            tf.zeros((0, 2), "float64"),
            shape=tf.TensorShape([None, 2]),
            trainable=False,
        )

    def _available_devices(self):
        if tf_devices.multi_worker_strategy() is not None:
            raise NotImplementedError(
                "pipeline_parallel on TensorFlow runs its stages on the "
                "devices of one host: with configure_multi_worker(), use "
                "pipeline_parallel=1, or the torch backend."
            )
        return tf_devices.local_devices()

    def _stages_of(self, x):
        """The stage primitives of the batch `x`, shared weights' copies
        refreshed."""
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
        self.check_batch_size(batch)
        count = self.microbatches(batch // self.data_parallel)
        if count not in self._stages:
            self._stages[count] = TensorFlowStages(self, count)
        self.refresh_copies()
        return self._stages[count]

    def action_times(self):
        return self.step_times.numpy()

    def calling_stage(self):
        running = [r.holds_local_values() for r in self.stage_runtimes]
        return running.index(True) if True in running else None

    def check_compiled(self, trainer):
        super().check_compiled(trainer)
        optimizer = trainer.optimizer
        averaging = unscaled(optimizer)
        # The stages' updates take one norm at each step (`_update`).
        if averaging.global_clipnorm and averaging.gradient_accumulation_steps:
            raise ValueError(
                "A pipeline on TensorFlow takes global_clipnorm over every "
                "stage's gradients at each step, but Keras clips accumulated "
                "gradients (gradient_accumulation_steps) once they are "
                "applied. Pass one of the two, or use the torch or JAX "
                "backend, whose pipelines clip the accumulated gradients."
            )
        # Keras' end of fit() finalizes the compiled optimizer (a loss
        # scale's, the one it wraps).
        if averaging.use_ema and not isinstance(averaging, _FinalizesStages):
            finalizing = type(averaging)
            finalizing = mixed_class(_FinalizesStages, "StagesOf", finalizing)
            mix_in(averaging, finalizing, _keras_tp_pipeline=self)
        # Built on no variable, the compiled optimizer keeps the step count
        # each stage's copy takes; the copies are made before the trace.
        if not optimizer.built:
            optimizer.build([])
        self.build_optimizer(trainer)

    def build_optimizer(self, trainer):
        """Makes each stage's copy of the compiled optimizer, once."""
        compiled = trainer.optimizer
        if self._optimizers_of is compiled:
            return
        # A loss scale is the pipeline's: the stages copy what it wraps.
        optimizer = unscaled(compiled)
        options = [getattr(optimizer, name) for name in _COORDINATED]
        coordinating = loss_scale(compiled) is not None or any(options)
        # Made eagerly, to outlive the trace of the first step.
        with tf.init_scope():
            config, trainers = optimizer.get_config(), []
            for stage, runtime in enumerate(self.stage_runtimes):
                trainer = _StageTrainer(
                    self.stage_models[stage], self.owners.owned(stage)
                )
                copy = type(optimizer).from_config(config)
                excluded = weight_decay_excluded(
                    optimizer, trainer.trainable_variables, runtime.former_keys
                )
                exclude_from_weight_decay(copy, excluded)
                # As the stage's runtime would compile it.
                trainer.optimizer = coordinated(
                    copy, runtime, trainer, coordinating
                )
                place_slots(trainer.optimizer, runtime)
                prepare_optimizer(runtime, trainer)
                trainers.append(trainer)
        self.stage_optimizers = trainers
        self._optimizers_of = compiled

    def run_step(self, phase, step, *args, **kwargs):
        step = getattr(self, f"{phase}_step")
        return self._traced(step, phase, *args, **kwargs)

    def _traced(self, step, phase, *args, **kwargs):
        # A stage's `data` collectives run in graphs only.
        if tf.executing_eagerly():
            step = tf.function(step)
        with self.stats.recording(phase):
            return step(*args, **kwargs)

    def train_step(self, data):
        x, targets = self.unpacked(data)
        self.build_optimizer(self.trainer)
        stages = self._stages_of(x)
        loss, y_pred = stages.step(x, targets)
        self.trained_order = stages.order
        owned = self._owned_gradients(stages)
        compiled = self.trainer.optimizer
        scaler = loss_scale(compiled)
        factor = finite = None
        if takes_global_norm(compiled):
            owned, factor, finite = self._globally_clipped(owned, scaler)
        # A step whose gradients overflowed anywhere is skipped everywhere.
        skips = None if scaler is None else finite
        for stage in range(self.pipeline_parallel):
            self._update(stage, owned, factor, skips)
        counted = 1 if scaler is None else tf.cast(finite, "int64")
        step_counter(unscaled(compiled)).assign_add(counted)
        if scaler is not None:
            new = next_scale(compiled, finite, scaler, compiled.step_counter)
            scaler.assign(new[0])
            compiled.step_counter.assign(new[1])
        return self.update_metrics(x, targets, loss, y_pred)

    def test_step(self, data):
        x, targets = self.unpacked(data)
        stages = self._stages_of(x)
        y_pred = stages.predict(x)
        loss = self.whole_batch_loss(targets, y_pred, stages.added_loss())
        return self.update_metrics(x, targets, loss, y_pred)

    def predict_step(self, data):
        return self._forward(keras.utils.unpack_x_y_sample_weight(data)[0])

    def _owned_gradients(self, stages):
        """By replica, `WeightOwners.owned_gradients` of its gradients."""
        gradients = stages.scaled_gradients()
        return [
            self.owners.owned_gradients(
                [gradients[s, r] for s in range(self.pipeline_parallel)],
                stages.send,
            )
            for r in range(self.data_parallel * self.tensor_parallel)
        ]

    def _globally_clipped(self, owned, scale):
        """`(gradients, factor, finite)`: by replica, each stage's gradients
        (synchronised where `global_clipnorm` clips them); the factor that
        clips them and unscales them by the loss `scale` (`parts_factor`);
        whether they are finite. The last stage's first device adds the
        squared norms."""
        synchronised, squares = [], []
        for index, runtime in enumerate(self.stage_runtimes):
            stage = self.stage_optimizers[index]

            def synchronise(runtime=runtime, stage=stage, index=index):
                variables = stage.trainable_variables
                grads = owned[runtime.replica_id()][index]
                with self.stats.labelled("optimizer"):
                    if self._clips():
                        grads = stage.optimizer.synchronised_gradients(
                            runtime.replica_gradients(grads, variables),
                            variables,
                        )
                    square = stage.optimizer.clipping.squared_norm(
                        grads, variables
                    )
                return grads, square

            results = runtime.replica_results(synchronise, stage)
            synchronised.append([grads for grads, _ in results])
            squares.append(results[0][1])
            self.stats.record("send", 4, "optimizer", "pipe")
            self.stats.record(
                "send", 4 * len(runtime.devices), "optimizer", "pipe"
            )
        with tf.device(self.stage_runtimes[-1].devices[0]):
            optimizer = self.trainer.optimizer
            factor, finite = parts_factor(optimizer, squares, scale)
            return list(zip(*synchronised)), factor, finite

    def _update(self, index, gradients, factor=None, finite=None):
        """Stage `index`'s update on each of its replicas from `gradients`
        (times a `factor`, where given), with the compiled optimizer's step
        count and learning rate; skipped unless `finite`, where given."""
        runtime = self.stage_runtimes[index]
        stage = self.stage_optimizers[index]
        compiled = unscaled(self.trainer.optimizer)
        optimizer = stage.inner_optimizer

        def apply():
            optimizer.iterations.assign(compiled.iterations)
            # A schedule computes the rate from the step count.
            if isinstance(compiled.learning_rate, keras.Variable):
                optimizer.learning_rate.assign(compiled.learning_rate)
            grads = gradients[runtime.replica_id()][index]
            variables = stage.trainable_variables
            if factor is not None:
                grads = scaled(grads, factor)
            # Without clipping the optimizer synchronises the gradients.
            clips = self._clips()
            taken = contextlib.nullcontext()
            if clips:
                taken = global_norm_taken(stage.optimizer.clipping)
            with taken:
                runtime.apply_on_replica(
                    stage.optimizer, grads, variables, stage, clips
                )
            # `strategy.run` needs a result to return.
            return tf.zeros(())

        def skippable():
            return tf.cond(finite, apply, lambda: tf.zeros(()))

        runtime.replica_results(apply if finite is None else skippable, stage)

    def _clips(self):
        return bool(unscaled(self.trainer.optimizer).global_clipnorm)

    def _forward(self, x, training=False):
        return self._stages_of(x).predict(x, training)

    def call_model(self, model, inputs, training):
        """A direct call (`tp(x)`); under sequence parallelism as `predict`
        runs (sequence shards exist only in replica steps)."""
        if not self.sequence_parallel:
            return super().call_model(model, inputs, training)
        return self._traced(self._forward, "call", inputs, bool(training))


class _FinalizesStages:
    """Mixed into a compiled optimizer whose stages' copies average the
    weights (`use_ema`): Keras' end of `fit()` writes each stage's."""

    def finalize_variable_values(self, var_list):
        for stage in self._keras_tp_pipeline.stage_optimizers:
            stage.optimizer.finalize_variable_values(stage.trainable_variables)


class _StageTrainer:
    """What a stage's `TensorFlowRuntime` reads of the model it trains."""

    def __init__(self, model, owned):
        self.model = model
        self.variables = model.variables
        self.non_trainable_variables = model.non_trainable_variables
        self.trainable_variables = owned
        self.optimizer = None

    @property
    def inner_optimizer(self):
        return getattr(self.optimizer, "inner_optimizer", self.optimizer)


# Options of the compiled optimizer that each stage's copy runs through a
# `CoordinatedOptimizer`.
_COORDINATED = ("global_clipnorm", "use_ema", "gradient_accumulation_steps")

PIPELINE_RUNTIME = TensorFlowPipelineRuntime
