"""Pipelines on TensorFlow: every stage a `tf.distribute` runtime of its own.

`TensorFlowPipelineRuntime` runs `TensorParallelKeras(world_size=W,
pipeline_parallel=P, data_parallel=D)`: every stage is a
`TensorFlowRuntime` over the stage's `D x T` devices (`T = W / (P x D)`,
its `data x model` mesh). That runtime stores the stage's variables (split
by tensor parallelism where `T > 1`), runs its split layers with the
collectives of its `model` axis, and updates the stage with an optimizer
of its own: a copy of the compiled one which, with replicas, a
`CoordinatedOptimizer` wraps to average the gradients over the stage's
`data` axis (and, with ZeRO-1, to partition the optimizer state there),
as every backend's pipeline replicas do. The schedule runs as replica
steps of the stages (`keras_tp.runtime.tensorflow.stages`), through the
pipeline's one executor. A weight a later stage also uses (a tied
embedding) is owned by the first stage that uses it; the later stage
keeps a copy of its pieces on its own replicas, refreshed once a step,
and its gradients join the owner's before the update
(`keras_tp.runtime.tensorflow.stage_storage`).
"""

import keras
import tensorflow as tf

from keras_tp.collectives.tensorflow import ReplicaStats
from keras_tp.keras_internals import place_slots_on_creation
from keras_tp.keras_internals import update_loss_tracker
from keras_tp.parallel import CoordinatedOptimizer
from keras_tp.pipeline.runtime import PipelineRuntime
from keras_tp.runtime.tensorflow import TensorFlowRuntime
from keras_tp.runtime.tensorflow import devices as tf_devices
from keras_tp.runtime.tensorflow.optimizer import prepare_optimizer
from keras_tp.runtime.tensorflow.stage_storage import StageStorage
from keras_tp.runtime.tensorflow.stages import TensorFlowStages
from keras_tp.runtime.tensorflow.stages import traced_batch_size
from keras_tp.tensors import nbytes


class TensorFlowPipelineRuntime(StageStorage, PipelineRuntime):
    """`PipelineRuntime` whose stages each run on a `TensorFlowRuntime`.

    Stage `s` of replica `d` runs on its `T` devices `stage_devices[s][d
    * T : (d + 1) * T]`; the stage's runtime holds the `D x T` devices of
    every replica. See the module docstring.

    Args: those of `PipelineRuntime`.

    Attributes:
        stage_runtimes: the `TensorFlowRuntime` of each stage.
        stage_optimizers: each stage's optimizer, made from the compiled
            one the first time the model trains (`build_optimizer`).
        peak_activations: after a training step was traced, per stage, the
            most micro-batches whose activations it held at once.
        last_num_microbatches: the micro-batch count of the last traced
            step, or `None` before any.
    """

    backend = "tensorflow"
    # Each replica runs the code between the split layers on its own
    # values, so `auto_plan` checks the plan for that.
    local_ranks = True
    # A weight several stages use is owned by the first; the later ones
    # keep a copy, refreshed once a step (`StageStorage.refresh_copies`).
    shares_weights = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Each collective is issued by every replica of its stage, and
        # counted once, by the stage's first replica.
        self.stats = ReplicaStats()
        self.stage_runtimes = self.stage_runtimes_of(TensorFlowRuntime)
        self.stage_optimizers = []
        # The compiled optimizer the stage optimizers were made from.
        self._optimizers_of = None
        # By `(stage, id(variable))`, `(variable, copy)`: a later stage's
        # copy of a weight an earlier stage owns (a tied embedding),
        # stored on its replicas.
        self._copies = {}
        # The stage primitives per micro-batch count: a batch of another
        # size may take another count.
        self._stages = {}
        # Those of the last training step.
        self._trained = None
        self.peak_activations = []
        self.last_num_microbatches = None

    def _available_devices(self):
        if tf_devices.multi_worker_strategy() is not None:
            raise NotImplementedError(
                "pipeline_parallel on TensorFlow runs its stages on the "
                "devices of one host: with configure_multi_worker(), use "
                "pipeline_parallel=1, or the torch backend."
            )
        return tf_devices.local_devices()

    def _stages_of(self, x):
        """The stage primitives for the batch `x`: the size of each
        replica's slice picks the micro-batch count."""
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
        if count not in self._stages:
            self._stages[count] = TensorFlowStages(
                self.stage_models,
                self.stage_runtimes,
                self._loss,
                self.schedule,
                count,
                self.stats,
                self.reading_copies if self._copies else None,
            )
        self.last_num_microbatches = count
        return self._stages[count]

    def _loss(self, y_true, y_pred):
        # Read when a step is traced: `predict` needs no compiled loss,
        # and a model compiled again uses its new loss.
        return self.loss_function()(y_true, y_pred)

    def measured_timeline(self):
        """The last training step's `schedules.Timeline` (see
        `TensorFlowStages.measured_timeline`), `None` before the first."""
        if self._trained is None:
            return None
        return self._trained.measured_timeline()

    def calling_stage(self):
        """The stage whose replicas run now, or `None`."""
        return next(
            (
                s
                for s, runtime in enumerate(self.stage_runtimes)
                if runtime._in_replica()
            ),
            None,
        )

    def check_compiled(self, trainer):
        super().check_compiled(trainer)
        # Each stage updates its variables with a copy of this optimizer
        # (`build_optimizer`): built on no variable, it keeps the step
        # count and holds no slot.
        if not trainer.optimizer.built:
            trainer.optimizer.build([])

    def build_optimizer(self, trainer):
        """Makes each stage's optimizer, once per compile: a copy of the
        compiled one (wrapped by a `CoordinatedOptimizer` with replicas),
        whose slots are built with the stage's variables."""
        optimizer = trainer.optimizer
        if self._optimizers_of is optimizer:
            return
        # The first step may make them while Keras traces it: they are
        # made eagerly, to outlive the trace.
        with tf.init_scope():
            if not optimizer.built:
                optimizer.build([])
            config, trainers = optimizer.get_config(), []
            for stage, runtime in enumerate(self.stage_runtimes):
                copy = type(optimizer).from_config(config)
                if runtime.optimizer_runtime is None:
                    place_slots_on_creation(copy, runtime.placement.place_like)
                else:
                    copy = CoordinatedOptimizer(
                        copy, zero_stage=self.zero_stage
                    )
                    runtime.bind_optimizer(copy)
                owned = self.owners.owned(stage)
                trainers.append(
                    _StageTrainer(self.stage_models[stage], copy, owned)
                )
                prepare_optimizer(runtime, trainers[-1])
        self.stage_optimizers = trainers
        self._optimizers_of = optimizer

    def run_step(self, phase, step, *args, **kwargs):
        step = getattr(self, f"{phase}_step")
        return self._traced(step, phase, *args, **kwargs)

    def _traced(self, step, phase, *args, **kwargs):
        """`step(*args)`, counted in `phase`. The collective groups of a
        stage's `data` axis run in graphs only: an eager step
        (`run_eagerly=True`, a direct call) is traced anew."""
        if tf.executing_eagerly():
            step = tf.function(step)
        with self.stats.recording(phase):
            return step(*args, **kwargs)

    def train_step(self, data):
        """Keras' train step: the schedule over the stages' replicas, then
        each stage's update on its replicas."""
        x, y = self._batch(data)
        self.build_optimizer(self.trainer)
        stages = self._stages_of(x)
        self.refresh_copies()
        loss, y_pred = stages.step(x, y)
        self._trained = stages
        self.peak_activations = list(stages.peak_activations)
        addends = self._owned_gradients(stages.gradients)
        for stage in range(self.pipeline_parallel):
            self._update(stage, addends)
        self.trainer.optimizer.iterations.assign_add(1)
        return self._logs(x, y, loss, y_pred)

    def test_step(self, data):
        """Keras' test step: each replica's stages' forward passes of its
        slice, then the loss and the metrics of the whole batch."""
        x, y = self._batch(data)
        y_pred = self._forward(x)
        return self._logs(x, y, self._loss(y, y_pred), y_pred)

    def predict_step(self, data):
        """Keras' predict step: each replica's stages' forward passes of
        its slice; the model's outputs of the batch, in its order."""
        return self._forward(keras.utils.unpack_x_y_sample_weight(data)[0])

    def _batch(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self.check_no_sample_weight(sample_weight)
        return x, y

    def _logs(self, x, y, loss, y_pred):
        """The metrics' logs, as Keras' steps return them."""
        update_loss_tracker(self.trainer, loss, traced_batch_size(x))
        return self.trainer.compute_metrics(x, y, y_pred, None)

    def _owned_gradients(self, gradients):
        """By `(stage, replica)`, per variable the stage owns, the
        gradients to add up for its update: its own and, for a weight
        later stages also use (a tied embedding), theirs, sent from their
        replica `(d, t)` to the owner's (counted on `"pipe"`; see
        `WeightOwners`).

        Args:
            gradients: `TensorFlowStages.gradients`.
        """

        def moved(grad, stage, owner):
            self.stats.record("send", nbytes(grad), "backward", "pipe")
            return grad

        replicas = sorted({replica for _, replica in gradients})
        return {
            (owner, replica): addends
            for replica in replicas
            for owner, addends in enumerate(
                self.owners.gradient_addends(
                    [
                        gradients[stage, replica]
                        for stage in range(self.pipeline_parallel)
                    ],
                    moved,
                )
            )
        }

    def _update(self, index, addends):
        """Stage `index`'s update on each of its replicas, from the sums of
        the replica's gradients (`_owned_gradients`), made there.

        The stage's optimizer first takes the compiled one's step count
        and learning rate: a callback (`ReduceLROnPlateau`) or a load sets
        those of the compiled optimizer.
        """
        runtime = self.stage_runtimes[index]
        stage = self.stage_optimizers[index]
        compiled = self.trainer.optimizer
        optimizer = stage.optimizer
        if isinstance(optimizer, CoordinatedOptimizer):
            optimizer = optimizer.inner_optimizer

        def update():
            replica = runtime._replica_id()
            optimizer.iterations.assign(compiled.iterations)
            # A schedule computes the rate from the step count.
            if isinstance(compiled.learning_rate, keras.Variable):
                optimizer.learning_rate.assign(compiled.learning_rate)
            runtime.apply_on_replica(
                stage.optimizer,
                [tf.add_n(grads) for grads in addends[index, replica]],
                stage.trainable_variables,
                stage,
            )
            # `strategy.run` needs a result to return.
            return tf.zeros(())

        runtime.replica_results(update, stage)

    def _forward(self, x, training=False):
        stages = self._stages_of(x)
        self.refresh_copies()
        return stages.predict(x, training)

    def call_model(self, model, inputs, training):
        """A direct call (`tp(x)`); under sequence parallelism it runs as
        `predict`'s steps do, since sequence shards exist only in the
        stages' replica steps."""
        if not self.sequence_parallel:
            return super().call_model(model, inputs, training)
        return self._traced(self._forward, "call", inputs, bool(training))


class _StageTrainer:
    """What a stage's `TensorFlowRuntime` reads of the model it trains
    (`prepare_optimizer`, the local shapes of a replica, the statistics
    averaged over `data`): the stage's model and variables, its own
    optimizer, and the trainable variables it owns (`owned`), which that
    optimizer updates."""

    def __init__(self, model, optimizer, owned):
        self.model = model
        self.optimizer = optimizer
        self.trainable_variables = owned

    @property
    def variables(self):
        return self.model.variables

    @property
    def non_trainable_variables(self):
        return self.model.non_trainable_variables


PIPELINE_RUNTIME = TensorFlowPipelineRuntime
