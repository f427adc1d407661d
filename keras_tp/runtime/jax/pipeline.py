"""Pipeline stages on JAX: one compiled program per stage, on its devices.

Each stage's forward pass is a jitted `jax.vjp` of the stage's Keras
model on that stage's devices (one, or several splitting its layers by
tensor parallelism); it returns the stage's outputs and the
`VJP` that holds its residuals (the activations the backward pass
needs). Each backward pass is a jitted call of one such `VJP`. Python
issues the actions in the order of a schedule (`keras_tp.pipeline.
schedules`), and JAX's asynchronous dispatch lets the devices of
different stages compute at the same time: a stage's call returns at
once, and an array sent to the next stage's device is copied when it is
ready. The activations of a micro-batch live in its `VJP` from its
forward pass to its backward pass, so a 1F1B order holds fewer of them
than GPipe's.
"""

import jax
import keras
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from keras_tp.collectives.base import nbytes
from keras_tp.keras_internals import StatelessScope
from keras_tp.keras_internals import jax_update_metrics
from keras_tp.pipeline import schedules
from keras_tp.pipeline.runner import ScheduledStages
from keras_tp.pipeline.runtime import PipelineRuntime
from keras_tp.runtime.jax import JaxRuntime
from keras_tp.runtime.jax import to_jax_device
from keras_tp.runtime.jax.steps import is_concrete


class JaxPipeline(ScheduledStages):
    """The stages of a pipeline, each compiled for its own devices.

    Args: those of `ScheduledStages`; `devices` are the `jax.sharding.Mesh`
    of each stage (one device, or the stage's tensor-parallel devices).
    """

    def __init__(
        self, stage_models, devices, loss, schedule, num_microbatches, stats
    ):
        super().__init__(
            stage_models, devices, loss, schedule, num_microbatches, stats
        )
        self._forwards = [
            counted_jit(self._forward_of(index), stats)
            for index in range(len(stage_models))
        ]
        self._backward = counted_jit(
            lambda vjp, cotangent: vjp(cotangent), stats
        )
        self.peak_activations = []

    def _forward_of(self, index):
        model = self.stage_models[index]
        last = index == len(self.stage_models) - 1
        microbatches = self.num_microbatches

        def forward(trainable, non_trainable, inputs, targets):
            def stage(trainable, inputs):
                outputs, new_non_trainable = model.stateless_call(
                    trainable, non_trainable, inputs, training=True
                )
                if not last:
                    return outputs, (new_non_trainable, None)
                # Each micro-batch's share of the batch's mean loss; the
                # predictions ride along for the metrics.
                loss = self.loss(targets, outputs) / microbatches
                return loss, (new_non_trainable, outputs)

            outputs, vjp, (new_non_trainable, predictions) = jax.vjp(
                stage, trainable, inputs, has_aux=True
            )
            return outputs, vjp, new_non_trainable, predictions

        return forward

    def step(self, trainable, non_trainable, x, y):
        """Runs the forward and backward passes of one batch.

        Args:
            trainable: each stage's trainable values, on its device.
            non_trainable: each stage's non-trainable values.
            x: the batch's inputs (NumPy or JAX arrays).
            y: the batch's targets.

        Returns:
            `(loss, gradients, non_trainable, predictions)`: the batch's
            mean loss, each stage's gradients summed over the micro-batches
            (of the mean loss), each stage's new non-trainable values, and
            the last stage's outputs of the whole batch.
            `peak_activations` then holds, per stage, the most
            micro-batches whose activations it held at once.
        """
        count = self.num_microbatches
        batch = len(jax.tree_util.tree_leaves(x)[0])
        schedules.check_microbatches(batch, count)
        size = batch // count

        last = len(self.stage_models) - 1
        targets = [_microbatch(y, m, size) for m in range(count)]
        received = {(0, m): _microbatch(x, m, size) for m in range(count)}
        predictions = [None] * count
        cotangents = {}
        vjps = {}
        non_trainable = list(non_trainable)
        gradients = [None] * len(self.stage_models)
        loss = 0.0
        in_flight = [0] * len(self.stage_models)
        self.peak_activations = [0] * len(self.stage_models)
        for stage, kind, m in self.order:
            mesh = self.devices[stage]
            if kind == schedules.FORWARD:
                in_flight[stage] += 1
                self.peak_activations[stage] = max(
                    self.peak_activations[stage], in_flight[stage]
                )
                outputs, vjps[stage, m], non_trainable[stage], predicted = (
                    self._forwards[stage](
                        trainable[stage],
                        non_trainable[stage],
                        onto(received.pop((stage, m)), mesh),
                        targets[m] if stage == last else None,
                    )
                )
                if stage == last:
                    loss = loss + outputs
                    predictions[m] = predicted
                    continue
                for tensor in jax.tree_util.tree_leaves(outputs):
                    self.stats.record("send", nbytes(tensor), "forward", "pipe")
                received[stage + 1, m] = outputs
                continue
            in_flight[stage] -= 1
            cotangent = (
                np.float32(1.0)
                if stage == last
                else onto(cotangents.pop((stage, m)), mesh)
            )
            grads, input_grads = self._backward(vjps.pop((stage, m)), cotangent)
            gradients[stage] = (
                grads
                if gradients[stage] is None
                else jax.tree_util.tree_map(
                    lambda a, b: a + b, gradients[stage], grads
                )
            )
            if stage > 0:
                for tensor in jax.tree_util.tree_leaves(input_grads):
                    # Integer inputs (a carried padding mask) have empty
                    # `float0` gradients, which carry no data.
                    if tensor.dtype != jax.dtypes.float0:
                        self.stats.record(
                            "send", nbytes(tensor), "backward", "pipe"
                        )
                cotangents[stage - 1, m] = input_grads
        return loss, gradients, non_trainable, _concatenated(predictions)


def onto(tree, mesh):
    """The arrays of `tree` placed on `mesh`, each keeping its split.

    An activation split over the sending stage's `model` axis (a Column
    layer's output) goes to the same split on the receiving stage: each
    device sends its shard to its counterpart. Other arrays arrive whole
    on every device of the stage.
    """

    def put(array):
        sharding = getattr(array, "sharding", None)
        spec = (
            sharding.spec
            if isinstance(sharding, NamedSharding)
            else PartitionSpec()
        )
        return jax.device_put(array, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map(put, tree)


def counted_jit(function, stats):
    """`jax.jit(function)` whose collectives count at every call.

    A region's collectives are recorded while the function is traced,
    once per input signature; each later call records them again.
    """
    records = {}

    def traced(*args):
        with stats.capturing() as added:
            outputs = function(*args)
        records[_signature(args)] = added
        return outputs

    compiled = jax.jit(traced)

    def call(*args):
        key = _signature(args)
        seen = key in records
        outputs = compiled(*args)
        if seen:
            stats.replay(records[key])
        return outputs

    return call


def _signature(tree):
    return tuple(
        (getattr(leaf, "shape", None), str(getattr(leaf, "dtype", type(leaf))))
        for leaf in jax.tree_util.tree_leaves(tree)
    )


def _microbatch(tree, m, size):
    """The `m`-th slice of `size` samples of every array of `tree`."""
    return jax.tree_util.tree_map(lambda a: a[m * size : (m + 1) * size], tree)


def _concatenated(parts):
    """The micro-batches' outputs joined back into the batch's."""
    return jax.tree_util.tree_map(
        lambda *leaves: jax.numpy.concatenate(leaves), *parts
    )


class JaxPipelineRuntime(PipelineRuntime):
    """Runs Keras' JAX steps as a pipeline of stages, one per device.

    Each stage's variables and optimizer slots are committed to its
    device. A training step runs the schedule (`JaxPipeline`), then one
    compiled optimizer update per stage on its device; evaluation and
    prediction send each micro-batch through the stages' compiled forward
    passes, which JAX's asynchronous dispatch overlaps across devices.
    Keras' JAX trainer passes the state as values (`train_step(state,
    data)`); the steps take and return them in its order.
    """

    backend = "jax"
    splits_stages = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Each stage's devices are a tensor-parallel runtime of their own,
        # which places the stage's variables and runs its split layers;
        # all count into this runtime's stats.
        self.stage_runtimes = []
        for devices in self.stage_devices:
            runtime = JaxRuntime(len(devices), devices, 1, 0)
            for adapter in (
                runtime.adapter,
                runtime.data_adapter,
                runtime.world_adapter,
            ):
                adapter.stats = self.stats
            self.stage_runtimes.append(runtime)
        self.meshes = [runtime.mesh for runtime in self.stage_runtimes]
        self._runners = {}
        self._updates = {}
        self._last_count = None
        self._inference = [
            counted_jit(self._inference_of(stage), self.stats)
            for stage in self.stage_models
        ]

    def _available_devices(self):
        return keras.distribution.list_devices()

    def check_compiled(self, trainer):
        super().check_compiled(trainer)
        # The compiled stage functions hold the loss and the optimizer of
        # the last compile().
        self._runners.clear()
        self._updates.clear()

    def place_variable(self, variable, axis):
        stage = self.stage_of[id(variable)]
        self.stage_runtimes[stage].placement.place(variable, axis)

    def place_variable_like(self, variable, reference, data_axis):
        stage = self.stage_of[id(reference)]
        self.stage_of[id(variable)] = stage
        self.stage_runtimes[stage].placement.place_like(variable, reference)

    def device_bytes(self, variables):
        """`{device: bytes}` of these variables, read from their arrays."""
        names = {to_jax_device(name): name for name in self.devices}
        totals = dict.fromkeys(self.devices, 0)
        for variable in variables:
            for shard in variable.value.addressable_shards:
                totals[names[shard.device]] += shard.data.nbytes
        return totals

    @property
    def peak_activations(self):
        """Per stage, the most micro-batches whose activations it held at
        once in the last training step."""
        runner = self._runners.get(self._last_count)
        return runner.peak_activations if runner else []

    def _runner(self, count):
        self._last_count = count
        if count not in self._runners:
            self._runners[count] = JaxPipeline(
                self.stage_models,
                self.meshes,
                self.loss_function(),
                self.schedule,
                count,
                self.stats,
            )
        return self._runners[count]

    def train_step(self, state, data):
        trainer = self.trainer
        trainable, non_trainable, optimizer_values, metrics = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self.check_no_sample_weight(sample_weight)
        batch = len(jax.tree_util.tree_leaves(x)[0])
        runner = self._runner(self.microbatches(batch))
        loss, gradients, stage_non_trainable, y_pred = runner.step(
            self.stage_lists(trainer.trainable_variables, trainable),
            self.stage_lists(trainer.non_trainable_variables, non_trainable),
            x,
            y,
        )
        trainable, optimizer_values = self._apply(
            trainable, optimizer_values, gradients
        )
        non_trainable = self._merged(
            trainer.non_trainable_variables, non_trainable, stage_non_trainable
        )
        logs, metrics = jax_update_metrics(
            trainer, metrics, loss, x, y, y_pred, sample_weight
        )
        return logs, (trainable, non_trainable, optimizer_values, metrics)

    def _apply(self, trainable, optimizer_values, gradients):
        """Each stage's optimizer update, compiled for its device.

        The optimizer's own variables (its step count, learning rate) are
        copied to every stage; each stage's update advances the step count
        alike, and the last stage's copy is kept.
        """
        trainer = self.trainer
        optimizer = trainer.optimizer
        variables = trainer.trainable_variables
        by_stage = self.stage_lists(variables, trainable)
        new_trainable = dict(zip(map(id, variables), trainable))
        new_optimizer = dict(
            zip(map(id, optimizer.variables), optimizer_values)
        )
        for stage, (values, grads) in enumerate(zip(by_stage, gradients)):
            if stage not in self._updates:
                self._updates[stage] = self._update_of(stage)
            update, own, slots, shared = self._updates[stage]
            mesh = self.meshes[stage]
            values, slot_values, shared_values = update(
                values,
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
        own = self.stage_models[stage].trainable_variables
        slots = [
            v for v in optimizer.variables if self.stage_of.get(id(v)) == stage
        ]
        shared = [v for v in optimizer.variables if id(v) not in self.stage_of]
        update = counted_jit(
            _update_of(optimizer, own, slots, shared), self.stats
        )
        return update, own, slots, shared

    def _merged(self, variables, values, stage_values):
        """`values` with each stage's new ones written over them."""
        merged = dict(zip(map(id, variables), values))
        for stage, new in zip(self.stage_models, stage_values):
            merged.update(zip(map(id, stage.non_trainable_variables), new))
        return [merged[id(v)] for v in variables]

    def _inference_of(self, stage_model):
        def forward(trainable, non_trainable, inputs):
            return stage_model.stateless_call(
                trainable, non_trainable, inputs, training=False
            )

        return forward

    def _forward(self, trainable, non_trainable, x):
        """The stages' forward passes of `x`, micro-batch by micro-batch.

        Returns:
            `(outputs, each stage's new non-trainable values)`.
        """
        batch = len(jax.tree_util.tree_leaves(x)[0])
        count = self.microbatches(batch)
        size = batch // count
        non_trainable = list(non_trainable)
        outputs = []
        for m in range(count):
            tensors = _microbatch(x, m, size)
            for stage, mesh in enumerate(self.meshes):
                if stage:
                    for tensor in jax.tree_util.tree_leaves(tensors):
                        self.stats.record(
                            "send", nbytes(tensor), "forward", "pipe"
                        )
                tensors, non_trainable[stage] = self._inference[stage](
                    trainable[stage],
                    non_trainable[stage],
                    onto(tensors, mesh),
                )
            outputs.append(tensors)
        return _concatenated(outputs), non_trainable

    def test_step(self, state, data):
        trainer = self.trainer
        trainable, non_trainable, metrics = state
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self.check_no_sample_weight(sample_weight)
        y_pred, stage_non_trainable = self._forward(
            self.stage_lists(trainer.trainable_variables, trainable),
            self.stage_lists(trainer.non_trainable_variables, non_trainable),
            x,
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
        with self.stats.recording("call"):
            outputs, _ = self._forward(
                [
                    [v.value for v in s.trainable_variables]
                    for s in self.stage_models
                ],
                [
                    [v.value for v in s.non_trainable_variables]
                    for s in self.stage_models
                ],
                inputs,
            )
        return outputs


def _update_of(optimizer, variables, slots, shared):
    """One stage's optimizer update, as a function of values.

    Args:
        optimizer: the compiled Keras optimizer.
        variables: the stage's trainable variables.
        slots: the optimizer's slots of those variables.
        shared: the optimizer's own variables (step count, learning rate).

    Returns:
        A function of `(values, slot_values, shared_values, gradients)`
        returning the new `(values, slot_values, shared_values)`.
    """

    def update(values, slot_values, shared_values, gradients):
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

        return (
            new(variables, values),
            new(slots, slot_values),
            new(shared, shared_values),
        )

    return update


def _or(value, default):
    return default if value is None else value


PIPELINE_RUNTIME = JaxPipelineRuntime
