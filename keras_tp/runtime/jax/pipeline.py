"""Pipeline stages on JAX: one compiled program per stage, on its devices.

Each stage's forward pass is a jitted `jax.vjp` of the stage's Keras
model on that stage's devices (one, or several splitting its layers by
tensor parallelism); it returns the stage's outputs and the
`VJP` that holds its residuals (the activations the backward pass
needs). Each backward pass is a jitted call of one such `VJP`. These
are the stage primitives (`JaxStages`) that the pipeline's executor
(`keras_tp.pipeline.executor`) runs in the order of a schedule, and
JAX's asynchronous dispatch lets the devices of different stages
compute at the same time: a stage's call returns at once, and an array
sent to the next stage's device is copied when it is ready. The
activations of a micro-batch live in its `VJP` from its
forward pass to its backward pass, so a 1F1B order holds fewer of them
than GPipe's.
"""

import functools

import jax
import keras

from keras_tp.keras_internals import StatelessScope
from keras_tp.keras_internals import jax_update_metrics
from keras_tp.pipeline import schedules
from keras_tp.pipeline.executor import peak_activations
from keras_tp.pipeline.executor import run_forward
from keras_tp.pipeline.executor import run_schedule
from keras_tp.pipeline.runtime import CallingStageRegions
from keras_tp.pipeline.runtime import PipelineRuntime
from keras_tp.runtime.jax import JaxRuntime
from keras_tp.runtime.jax.replicated_stages import ReplicaGradients
from keras_tp.runtime.jax.replicated_stages import ReplicatedStagePrograms
from keras_tp.runtime.jax.stage_storage import StageStorage
from keras_tp.runtime.jax.stages import TRACING_STAGE
from keras_tp.runtime.jax.stages import JaxStages
from keras_tp.runtime.jax.stages import StagePrograms
from keras_tp.runtime.jax.stages import batch_size
from keras_tp.runtime.jax.stages import count_received
from keras_tp.runtime.jax.stages import counted_jit
from keras_tp.runtime.jax.stages import onto
from keras_tp.runtime.jax.steps import is_concrete


class JaxPipelineRuntime(StageStorage, PipelineRuntime):
    """Runs Keras' JAX steps as a pipeline of stages, one per device.

    Each stage's variables and optimizer slots are committed to its
    device. A training step runs the schedule (`JaxStages`), then one
    compiled optimizer update per stage on its device; evaluation and
    prediction send each micro-batch through the stages' compiled forward
    passes, which JAX's asynchronous dispatch overlaps across devices.
    Keras' JAX trainer passes the state as values (`train_step(state,
    data)`); the steps take and return them in its order.
    """

    backend = "jax"
    # A weight several stages use (a tied embedding) lives on the first
    # one's devices; the others receive a copy each step, and their
    # gradients of it are added to the first's before its update.
    shares_weights = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Each stage's devices are a runtime of their own (a `data x model`
        # mesh), which places the stage's variables and runs its split
        # layers; all count into this runtime's stats.
        self.stage_runtimes = self.stage_runtimes_of(JaxRuntime)
        # The compiled training passes, per micro-batch count.
        self._training_programs = {}
        self._updates = {}
        # The micro-batch count of the last training step.
        self._trained_count = None

    @property
    def local_ranks(self):
        # With replicas each stage's passes run per device (a per-rank
        # step), so `auto_plan` checks the plan for ranks that hold their
        # own values.
        return self.stage_runtimes[0].local_ranks

    def _available_devices(self):
        return keras.distribution.list_devices()

    # Inference programs, built once the variables are placed: on whole
    # arrays (any batch, for `tp(x)`), and the replicas' own, each on its
    # slice of a batch, for `evaluate` and `predict`.

    @functools.cached_property
    def _whole_programs(self):
        return StagePrograms(
            self.stage_models, self.stage_runtimes, None, None, self.stats
        )

    @functools.cached_property
    def _step_programs(self):
        if self.data_parallel == 1:
            return self._whole_programs
        return ReplicatedStagePrograms(
            self.stage_models, self.stage_runtimes, None, None, self.stats
        )

    def check_compiled(self, trainer):
        super().check_compiled(trainer)
        # The compiled stage functions hold the loss and the optimizer of
        # the last compile().
        self._training_programs.clear()
        self._trained_count = None
        self._updates.clear()

    def calling_stage_runtime(self, stages):
        # Each stage's program is traced under its index.
        return CallingStageRegions(
            {s: self.stage_runtimes[s] for s in stages}, TRACING_STAGE.get
        )

    def measured_timeline(self):
        """The last training step's `schedules.Timeline`, from the times
        each stage's programs ran on its devices (see `StageClock`), or
        `None` before the first step."""
        if self._trained_count is None:
            return None
        programs = self._training_programs[self._trained_count]
        return programs.clock.timeline(self._order(self._trained_count))

    @property
    def peak_activations(self):
        """Per stage, the most micro-batches whose activations it held at
        once in the last training step."""
        if self._trained_count is None:
            return []
        return peak_activations(
            self._order(self._trained_count), self.pipeline_parallel
        )

    def _order(self, count):
        return schedules.issue_order(
            self.schedule, self.pipeline_parallel, count
        )

    def _programs_of(self, count):
        """The compiled training passes of `count` micro-batches."""
        if count not in self._training_programs:
            programs = (
                ReplicatedStagePrograms
                if self.data_parallel > 1
                else StagePrograms
            )
            self._training_programs[count] = programs(
                self.stage_models,
                self.stage_runtimes,
                self.loss_function(),
                count,
                self.stats,
            )
        return self._training_programs[count]

    def train_step(self, state, data):
        trainer = self.trainer
        trainable, non_trainable, optimizer_values, metrics = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self.check_no_sample_weight(sample_weight)
        batch = batch_size(x)
        self.check_batch_size(batch)
        replica_batch = batch // self.data_parallel
        count = self.microbatches(replica_batch)
        self._trained_count = count
        stages = JaxStages(
            self._programs_of(count),
            self.stage_lists(trainer.trainable_variables, trainable),
            self.stage_lists(trainer.non_trainable_variables, non_trainable),
            count,
        )
        loss, y_pred = run_schedule(stages, self._order(count), x, y)
        trainable, optimizer_values = self._apply(
            trainable, optimizer_values, stages.gradients
        )
        non_trainable = self._merged(
            trainer.non_trainable_variables, non_trainable, stages.non_trainable
        )
        logs, metrics = jax_update_metrics(
            trainer, metrics, loss, x, y, y_pred, sample_weight
        )
        return logs, (trainable, non_trainable, optimizer_values, metrics)

    def stage_lists(self, variables, values):
        """`values` grouped by stage (see `PipelineRuntime.stage_lists`),
        each on its stage's devices: a stage that uses a weight of an
        earlier stage receives a copy (counted on `"pipe"`)."""
        grouped = super().stage_lists(variables, values)
        listed = {id(v) for v in variables}
        for stage, group in enumerate(grouped):
            members = [
                v for v in self.stage_models[stage].variables if id(v) in listed
            ]
            for i, variable in enumerate(members):
                if self.stage_of[id(variable)] != stage:
                    group[i] = onto(group[i], self.stage_runtimes[stage].mesh)
                    count_received(self.stats, group[i], "forward")
        return grouped

    def _owned_gradients(self, gradients):
        """Per stage, the gradients of the trainable variables it owns: a
        shared weight's gradients from every stage that uses it, added on
        its owner's devices (see `WeightOwners`)."""

        def moved(grad, stage, owner):
            grad = onto(grad, self.stage_runtimes[owner].mesh)
            count_received(self.stats, grad, "backward")
            return grad

        return [
            [
                functools.reduce(
                    lambda a, b: jax.tree_util.tree_map(jax.numpy.add, a, b),
                    addends,
                )
                for addends in stage
            ]
            for stage in self.owners.gradient_addends(gradients, moved)
        ]

    def _apply(self, trainable, optimizer_values, gradients):
        """Each stage's optimizer update, compiled for its device.

        The optimizer's own variables (its step count, learning rate) are
        copied to every stage; each stage's update advances the step count
        alike, and the last stage's copy is kept.
        """
        trainer = self.trainer
        optimizer = trainer.optimizer
        variables = trainer.trainable_variables
        new_trainable = dict(zip(map(id, variables), trainable))
        new_optimizer = dict(
            zip(map(id, optimizer.variables), optimizer_values)
        )
        gradients = self._owned_gradients(gradients)
        for stage, grads in enumerate(gradients):
            if stage not in self._updates:
                self._updates[stage] = self._update_of(stage)
            update, own, slots, shared = self._updates[stage]
            mesh = self.stage_runtimes[stage].mesh
            values, slot_values, shared_values = update(
                [new_trainable[id(v)] for v in own],
                [new_optimizer[id(v)] for v in slots],
                onto([new_optimizer[id(v)] for v in shared], mesh),
                grads,
            )
            new_trainable.update(zip(map(id, own), values))
            new_optimizer.update(zip(map(id, slots), slot_values))
            stage_shared = dict(zip(map(id, shared), shared_values))
        new_optimizer.update(stage_shared)
        return (
            [new_trainable[id(v)] for v in variables],
            [new_optimizer[id(v)] for v in optimizer.variables],
        )

    def _update_of(self, stage):
        """`(update, variables, slots, shared)` of a stage: its compiled
        optimizer update (`_update_of`) and the variables it reads."""
        optimizer = self.trainer.optimizer
        own = self.owners.owned(stage)
        slots = [
            v for v in optimizer.variables if self.stage_of.get(id(v)) == stage
        ]
        shared = [v for v in optimizer.variables if id(v) not in self.stage_of]
        replicas = (
            ReplicaGradients(
                self.stage_runtimes[stage], own, self.zero_stage, self.stats
            )
            if self.data_parallel > 1
            else None
        )
        update = counted_jit(
            _update_of(optimizer, own, slots, shared, replicas), self.stats
        )
        return update, own, slots, shared

    def _merged(self, variables, values, stage_values):
        """`values` with each stage's new ones written over them."""
        merged = dict(zip(map(id, variables), values))
        for stage, new in zip(self.stage_models, stage_values):
            merged.update(zip(map(id, stage.non_trainable_variables), new))
        return [merged[id(v)] for v in variables]

    def _forward(self, trainable, non_trainable, x, programs):
        """The stages' forward passes of `x`, micro-batch by micro-batch.

        Args:
            trainable, non_trainable: each stage's values.
            x: the inputs.
            programs: the `StagePrograms` that run them.

        Returns:
            `(outputs, each stage's new non-trainable values)`.
        """
        batch = batch_size(x)
        replicas = programs.data_parallel
        if replicas > 1:
            self.check_batch_size(batch)
        stages = JaxStages(
            programs,
            trainable,
            non_trainable,
            self.microbatches(batch // replicas),
        )
        outputs = programs.join_batch(run_forward(stages, x))
        return outputs, stages.non_trainable

    def test_step(self, state, data):
        trainer = self.trainer
        trainable, non_trainable, metrics = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self.check_no_sample_weight(sample_weight)
        y_pred, stage_non_trainable = self._forward(
            self.stage_lists(trainer.trainable_variables, trainable),
            self.stage_lists(trainer.non_trainable_variables, non_trainable),
            x,
            self._step_programs,
        )
        loss = self.loss_function()(y, y_pred)
        non_trainable = self._merged(
            trainer.non_trainable_variables, non_trainable, stage_non_trainable
        )
        logs, metrics = jax_update_metrics(
            trainer, metrics, loss, x, y, y_pred, sample_weight
        )
        return logs, (trainable, non_trainable, metrics)

    def predict_step(self, state, data):
        trainer = self.trainer
        trainable, non_trainable = state
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        y_pred, stage_non_trainable = self._forward(
            self.stage_lists(trainer.trainable_variables, trainable),
            self.stage_lists(trainer.non_trainable_variables, non_trainable),
            x,
            self._step_programs,
        )
        return y_pred, self._merged(
            trainer.non_trainable_variables, non_trainable, stage_non_trainable
        )

    def call_model(self, model, inputs, training):
        """A direct call `tp(x)` on arrays runs the stages on their devices.

        A symbolic call (Keras building its metrics) runs the stages as a
        graph, as on one device.
        """
        if not all(map(is_concrete, jax.tree_util.tree_leaves(inputs))):
            return super().call_model(model, inputs, training)
        trainer = self.trainer
        with self.stats.recording("call"):
            outputs, _ = self._forward(
                self.stage_lists(
                    trainer.trainable_variables,
                    [v.value for v in trainer.trainable_variables],
                ),
                self.stage_lists(
                    trainer.non_trainable_variables,
                    [v.value for v in trainer.non_trainable_variables],
                ),
                inputs,
                self._whole_programs,
            )
        return outputs


def _update_of(optimizer, variables, slots, shared, replicas=None):
    """One stage's optimizer update, as a function of values.

    Args:
        optimizer: the compiled Keras optimizer.
        variables: the stage's trainable variables.
        slots: the optimizer's slots of those variables.
        shared: the optimizer's own variables (step count, learning rate).
        replicas: with replicas, their `ReplicaGradients`, which combine
            their gradients and updates; `None` without.

    Returns:
        A function of `(values, slot_values, shared_values, gradients)`
        returning the new `(values, slot_values, shared_values)`.
    """

    def update(values, slot_values, shared_values, gradients):
        if replicas is not None:
            gradients = replicas.reduce(gradients)
            values = replicas.partitioned(values)
        mapping = [
            *zip(variables, values),
            *zip(slots, slot_values),
            *zip(shared, shared_values),
        ]
        with StatelessScope(state_mapping=mapping) as scope:
            optimizer.apply(gradients, variables)

        def new(group, old):
            return [
                _or(scope.get_current_value(v), value)
                for v, value in zip(group, old)
            ]

        new_values = new(variables, values)
        if replicas is not None:
            new_values = replicas.gathered(new_values)
        return (
            new_values,
            new(slots, slot_values),
            new(shared, shared_values),
        )

    return update


def _or(value, default):
    return default if value is None else value


PIPELINE_RUNTIME = JaxPipelineRuntime
