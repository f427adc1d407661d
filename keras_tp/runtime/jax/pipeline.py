"""JAX pipelines: Keras' steps run through each stage's compiled passes
(`keras_tp.runtime.jax.stages`) and optimizer update, on its devices."""

import collections

import jax
import keras

from keras_tp.collectives.jax import counted_jit
from keras_tp.keras_internals import StatelessScope
from keras_tp.keras_internals import accumulated_gradient
from keras_tp.keras_internals import clipping_by
from keras_tp.keras_internals import jax_update_metrics
from keras_tp.keras_internals import updating_only
from keras_tp.parallel.clipping import parts_factor
from keras_tp.parallel.clipping import takes_global_norm
from keras_tp.parallel.loss_scaling import loss_scale
from keras_tp.parallel.loss_scaling import next_scale
from keras_tp.parallel.loss_scaling import unscaled
from keras_tp.pipeline.executor import run_forward
from keras_tp.pipeline.executor import run_schedule
from keras_tp.pipeline.runtime import PipelineRuntime
from keras_tp.pipeline.runtime import weighted
from keras_tp.runtime.jax import JaxRuntime
from keras_tp.runtime.jax.devices import to_jax_device
from keras_tp.runtime.jax.stages import TRACING_STAGE
from keras_tp.runtime.jax.stages import JaxStages
from keras_tp.runtime.jax.stages import StagePrograms
from keras_tp.runtime.jax.steps import is_concrete
from keras_tp.runtime.jax.storage import onto
from keras_tp.runtime.padding import batch_size
from keras_tp.tensors import scaled


class JaxPipelineRuntime(PipelineRuntime):
    """Runs Keras' JAX steps (Keras' state in, new state out) as a
    pipeline of stages, then a compiled update per stage on its devices.
    Each stage's `JaxRuntime` stores the variables its stage owns (ZeRO-1
    partitions the slots over its replicas); a later stage that uses a
    weight receives a copy each step (`stage_lists`)."""

    backend = "jax"
    # Each stage's programs are traced under its index.
    calling_stage = staticmethod(TRACING_STAGE.get)
    # Each stage's update runs on its whole arrays (`_update_of`).
    updates_pieces = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.stage_runtimes = self.stage_runtimes_of(JaxRuntime)
        # `StagePrograms` by `_stages`' key, and each stage's update.
        self._compiled = {}
        self._updates = []
        # The programs of the last training step.
        self._trained = None

    @property
    def local_ranks(self):
        # With replicas each stage's passes run per device.
        return self.stage_runtimes[0].local_ranks

    def _available_devices(self):
        return keras.distribution.list_devices()

    def check_compiled(self, trainer):
        super().check_compiled(trainer)
        # Training programs and updates hold the last compile()'s loss and
        # optimizer.
        self._compiled = {
            k: p for k, p in self._compiled.items() if k[0] is None
        }
        self._trained = self.trained_order = None
        self._updates.clear()

    def action_times(self):
        return self._trained.clock.times(self.trained_order)

    def local_pieces(self, variable):
        # The optimizer's own variables, unplaced, with the first stage's.
        runtime = self.stage_runtime_of(variable) or self.stage_runtimes[0]
        return runtime.local_pieces(variable)

    def device_bytes(self, variables):
        """`{device: bytes}` of these variables, by the stage runtimes."""
        totals = {}
        for runtime in self.stage_runtimes:
            totals.update(runtime.device_bytes(variables))
        return {name: totals[str(to_jax_device(name))] for name in self.devices}

    def _stages(self, x, trainable, non_trainable, per_device=True, seed=None):
        """The `JaxStages` of a step on `x` and Keras' values (per device
        with replicas unless `per_device=False`): a training step's where
        the backward passes take the loss's gradient `seed`."""
        per_device = per_device and self.data_parallel > 1
        replicas = self.data_parallel if per_device else 1
        batch = batch_size(x)
        if per_device:
            self.check_batch_size(batch)
        count = self.microbatches(batch // replicas)
        # Inference programs serve every micro-batch count.
        key = (None if seed is None else count, per_device)
        if key not in self._compiled:
            self._compiled[key] = StagePrograms(self, per_device, key[0])
        trainer = self.trainer
        return JaxStages(
            self._compiled[key],
            self.stage_lists(trainer.trainable_variables, trainable),
            self.stage_lists(trainer.non_trainable_variables, non_trainable),
            count,
            seed,
        )

    def train_step(self, state, data):
        trainable, non_trainable, optimizer_values, metrics = state
        x, targets = self.unpacked(data)
        mapping = zip(self.trainer.optimizer.variables, optimizer_values)
        with StatelessScope(state_mapping=list(mapping)):
            seed = self.loss_seed()
        stages = self._stages(x, trainable, non_trainable, seed=seed)
        self._trained, self.trained_order = stages.programs, stages.order
        loss, y_pred = run_schedule(stages, stages.order, x, targets)
        trainable, optimizer_values = self._apply(
            trainable, optimizer_values, stages.scaled_gradients()
        )
        non_trainable = self._merged(non_trainable, stages.non_trainable)
        logs, metrics = self._metrics(metrics, loss, x, targets, y_pred)
        return logs, (trainable, non_trainable, optimizer_values, metrics)

    def test_step(self, state, data):
        trainable, non_trainable, metrics = state
        x, targets = self.unpacked(data)
        stages = self._stages(x, trainable, non_trainable)
        y_pred = run_forward(stages, x)
        non_trainable = self._merged(non_trainable, stages.non_trainable)
        loss = self.whole_batch_loss(targets, y_pred, stages.added_loss())
        logs, metrics = self._metrics(metrics, loss, x, targets, y_pred)
        return logs, (trainable, non_trainable, metrics)

    def _metrics(self, metrics, loss, x, targets, y_pred):
        """`(logs, new metrics values)` of a step, as Keras' updates them."""
        y, weights = weighted(targets)
        return jax_update_metrics(
            self.trainer, metrics, loss, x, y, y_pred, weights
        )

    def predict_step(self, state, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        return self._infer(*state, x)

    def call_model(self, model, inputs, training):
        """A direct call `tp(x)` on arrays runs the stages on their
        devices; a symbolic one (Keras building its metrics) as a graph."""
        if not all(map(is_concrete, jax.tree_util.tree_leaves(inputs))):
            return super().call_model(model, inputs, training)
        with self.stats.recording("call"):
            return self._infer(
                [v.value for v in self.trainer.trainable_variables],
                [v.value for v in self.trainer.non_trainable_variables],
                inputs,
                per_device=False,
            )[0]

    def _infer(self, trainable, non_trainable, x, per_device=True):
        stages = self._stages(x, trainable, non_trainable, per_device)
        outputs = run_forward(stages, x)
        return outputs, self._merged(non_trainable, stages.non_trainable)

    def _merged(self, values, stage_values):
        """Keras' non-trainable `values`, updated by each stage's."""
        variables = self.trainer.non_trainable_variables
        merged = dict(zip(map(id, variables), values))
        for stage, new in zip(self.stage_models, stage_values):
            merged.update(zip(map(id, stage.non_trainable_variables), new))
        return [merged[id(v)] for v in variables]

    def stage_lists(self, variables, values):
        """`values` of `variables` by stage, in its model's order, with
        copies (`sent`) of earlier stages' weights."""
        by_id = dict(zip(map(id, variables), values))
        return [
            [
                by_id[id(v)]
                if self.stage_of[id(v)] == stage
                else self.sent(by_id[id(v)], stage, "forward")
                for v in model.variables
                if id(v) in by_id
            ]
            for stage, model in enumerate(self.stage_models)
        ]

    def sent(self, tree, stage, direction):
        """`tree` placed on `stage`'s devices, its shards counted as sent
        (`float0` gradients carry no data)."""
        tree = onto(tree, self.stage_runtimes[stage].mesh)
        for leaf in jax.tree.leaves(tree):
            if leaf.dtype != jax.dtypes.float0:
                received = sum(s.data.nbytes for s in leaf.addressable_shards)
                self.stats.record("send", received, direction, "pipe")
        return tree

    def _apply(self, trainable, optimizer_values, gradients):
        """Each stage's compiled update on its devices; every stage advances
        a copy of the optimizer's own variables alike, the last's kept."""
        trainer = self.trainer
        variables = trainer.trainable_variables
        optimizer_variables = trainer.optimizer.variables
        values = dict(zip(map(id, variables), trainable))
        values.update(zip(map(id, optimizer_variables), optimizer_values))
        shared = [v for v in optimizer_variables if id(v) not in self.stage_of]
        shared_values = [values[id(v)] for v in shared]
        owned = self.owners.owned_gradients(gradients, self.sent)
        if not self._updates:
            stages = range(self.pipeline_parallel)
            self._updates = [self._update_of(s, shared) for s in stages]
        # Averaged over the stage's replicas (ZeRO-1: each partition).
        owned = [u.synchronise(g) for u, g in zip(self._updates, owned)]
        scale = loss_scale(trainer.optimizer)
        clips, finite = [None] * len(owned), None
        if takes_global_norm(trainer.optimizer):
            owned, clips, finite = self._globally_clipped(owned, values, scale)
        # With a loss scale, every stage keeps its values where the
        # gradients overflowed anywhere, decided on the devices.
        skips = scale is not None
        for stage, (update, grads) in enumerate(zip(self._updates, owned)):
            applies = self.sent(finite, stage, "optimizer") if skips else None
            new = update.update(
                [values[id(v)] for v in update.variables],
                [values[id(v)] for v in update.slots],
                onto(shared_values, self.stage_runtimes[stage].mesh),
                grads,
                applies,
                clips[stage],
            )
            values.update(zip(map(id, update.variables), new[0]))
            values.update(zip(map(id, update.slots), new[1]))
            values.update((id(shared[i]), value) for i, value in new[2].items())
        if skips:
            scaler = trainer.optimizer
            counter = scaler.step_counter
            values[id(scale)], values[id(counter)] = next_scale(
                scaler, finite, values[id(scale)], values[id(counter)]
            )
        return (
            [values[id(v)] for v in variables],
            [values[id(v)] for v in optimizer_variables],
        )

    def _globally_clipped(self, owned, values, scale):
        """`(gradients, clips, finite)`: each stage's gradients, unscaled by
        a loss scale; per stage, the factor that clips what its optimizer
        clips (with accumulation, the accumulated mean) by the norm over
        every stage, or `None`s without `global_clipnorm`; and whether
        that norm is finite, on the last stage's devices."""
        if scale is not None:
            inverse = 1 / values[id(scale)]
            owned = [
                scaled(grads, self.sent(inverse, stage, "optimizer"))
                for stage, grads in enumerate(owned)
            ]
        optimizer = unscaled(self.trainer.optimizer)
        steps = optimizer.gradient_accumulation_steps
        squares = []
        for update, grads in zip(self._updates, owned):
            if steps:
                grads = [
                    (g + values[id(accumulated_gradient(optimizer, v))]) / steps
                    for g, v in zip(grads, update.variables)
                ]
            squares.append(
                self.sent(update.squared_norm(grads), -1, "optimizer")
            )
        factor, finite = parts_factor(optimizer, squares, None)
        clips = [self.sent(factor, s, "optimizer") for s in range(len(owned))]
        return owned, clips, finite

    def _update_of(self, stage, shared):
        """A stage's compiled `StageUpdate`: `synchronise` of the backward
        passes' gradients; `update` of `(values, slot values, shared
        values, gradients, applies, clip)` to new values, of the shared
        ones those it assigned by index (the old ones where `applies` is
        false; gradients times `clip` where given); `squared_norm` of
        synchronised gradients; the `variables` and `slots` it updates."""
        # A loss scale's own variables are `_apply`'s (it skips or not).
        optimizer = unscaled(self.trainer.optimizer)
        own = self.owners.owned(stage)
        slots = [
            v for v in optimizer.variables if self.stage_of.get(id(v)) == stage
        ]
        variables = (own, slots, shared)

        def update(
            values, slot_values, shared_values, gradients, applies, clip
        ):
            groups = list(zip(variables, (values, slot_values, shared_values)))
            mapping = [pair for group in groups for pair in zip(*group)]
            with (
                StatelessScope(state_mapping=mapping) as scope,
                updating_only(optimizer, own, slots + shared),
                clipping_by(optimizer, clip),
            ):
                before = [scope.get_current_value(v) for v in shared]
                optimizer.apply(gradients, own)

            def new(variable, value):
                current = scope.get_current_value(variable)
                if current is None or applies is None:
                    return value if current is None else current
                return jax.numpy.where(applies, current, value)

            # Of the rest, what it assigned: the step count, or state of
            # its own variables made without a reference (Adafactor's
            # factored moments).
            assigned = {
                i: new(v, value)
                for i, (v, value) in enumerate(zip(*groups[2]))
                if scope.get_current_value(v) is not before[i]
            }
            return [*map(new, *groups[0])], [*map(new, *groups[1])], assigned

        runtime = self.stage_runtimes[stage]
        specs = [runtime.variable_spec(v) for v in own]
        synchronise = None
        if self.data_parallel > 1:
            synchronise, update, specs = runtime.over_replicas(update, own)
            synchronise = counted_jit(synchronise, self.stats)
        return StageUpdate(
            synchronise or (lambda gradients: gradients),
            counted_jit(update, self.stats),
            own,
            slots,
            counted_jit(runtime.squared_norm(own, specs), self.stats),
        )


StageUpdate = collections.namedtuple(
    "StageUpdate", "synchronise update variables slots squared_norm"
)


PIPELINE_RUNTIME = JaxPipelineRuntime
