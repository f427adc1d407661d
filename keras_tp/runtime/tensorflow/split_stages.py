"""Pipeline stages split over several devices each, on TensorFlow.

`SplitStagesRuntime` runs `TensorParallelKeras(world_size=W,
pipeline_parallel=P, data_parallel=D)` where each stage has `T = W /
(P x D)` > 1 devices per replica, or with `zero_stage=1`: every stage is
a `TensorFlowRuntime` of its own, a `tf.distribute` strategy over the
stage's `D x T` devices (its `data x model` mesh). That runtime stores
the stage's variables split by tensor parallelism, runs its split layers
with the collectives of its `model` axis, and updates the stage with an
optimizer of its own: a copy of the compiled one which, with replicas,
a `CoordinatedOptimizer` wraps to average the gradients over the stage's
`data` axis (and, with ZeRO-1, to partition the optimizer state there).

The runner (`SplitStagesPipeline`) issues each action of the schedule as
one `strategy.run` of its stage, in one traced step: replica `(d, t)` of
a stage receives its inputs from replica `(d, t)` of the previous stage
(its copy of an activation, or its shard of one a split layer leaves
split), as Megatron-LM's stages do, and sends back their gradients.
Under sequence parallelism each stage gathers its outputs' sequence
shards at its end. A weight a later stage also uses (a tied embedding)
is owned by the first stage that uses it; the later stage keeps a copy
of its pieces on its own replicas, refreshed once a step, and its
gradients join the owner's before the update.
"""

import contextlib

import keras
import tensorflow as tf

from keras_tp.collectives.base import nbytes
from keras_tp.collectives.tensorflow import ReplicaStats
from keras_tp.keras_internals import place_slots_on_creation
from keras_tp.keras_internals import set_stored_value
from keras_tp.keras_internals import stored_value
from keras_tp.keras_internals import update_loss_tracker
from keras_tp.parallel import CoordinatedOptimizer
from keras_tp.pipeline import schedules
from keras_tp.pipeline.runtime import CallingStageRegions
from keras_tp.pipeline.runtime import one_device_keys
from keras_tp.pipeline.runtime import stage_slots
from keras_tp.runtime.tensorflow import TensorFlowRuntime
from keras_tp.runtime.tensorflow.devices import device_name
from keras_tp.runtime.tensorflow.optimizer import prepare_optimizer
from keras_tp.runtime.tensorflow.whole_stages import TensorFlowPipeline
from keras_tp.runtime.tensorflow.whole_stages import TensorFlowPipelineRuntime
from keras_tp.runtime.tensorflow.whole_stages import batch_part
from keras_tp.runtime.tensorflow.whole_stages import concatenated
from keras_tp.runtime.tensorflow.whole_stages import floating
from keras_tp.runtime.tensorflow.whole_stages import traced_batch_size


class SplitStagesPipeline(TensorFlowPipeline):
    """A pipeline whose stages each run on the replicas of a runtime.

    Every value that crosses a cut is a list with one structure per
    replica of the stage, in replica order (`d * T + t`); so are the
    losses and outputs of the last stage.

    Args:
        stage_models: the Keras model of each stage.
        runtimes: the `TensorFlowRuntime` of each stage's devices.
        loss, schedule, num_microbatches, stats: as `TensorFlowPipeline`'s.
        reading_copies: a function of a stage's index returning the
            context in which its replicas read their copies of the weights
            it shares with an earlier stage; `None`: it shares none.

    Attributes:
        gradients: after a training step was traced, by `(stage,
            replica)`, the replica's gradients of the stage's trainable
            variables, summed over the micro-batches.
    """

    def __init__(
        self,
        stage_models,
        runtimes,
        loss,
        schedule,
        num_microbatches,
        stats,
        reading_copies=None,
    ):
        # The times of a stage's actions are taken on its first device.
        super().__init__(
            stage_models,
            [runtime.devices[0] for runtime in runtimes],
            loss,
            schedule,
            num_microbatches,
            stats,
        )
        self.runtimes = runtimes
        self.reading_copies = reading_copies
        self.tensor_parallel = runtimes[0].tensor_parallel
        self.data_parallel = runtimes[0].data_parallel

    def _replica_results(self, stage, fn):
        """`fn` run on each replica of `stage`, which reads its copies of
        the weights it shares with an earlier stage."""
        reading = (
            self.reading_copies(stage)
            if self.reading_copies
            else contextlib.nullcontext()
        )
        with reading:
            return self.runtimes[stage].replica_results(
                fn, self.stage_models[stage]
            )

    def _per_replica(self, x):
        """Per micro-batch, per replica, micro-batch `m` of the replica's
        data-parallel row of `x`."""
        count = self.num_microbatches
        row = traced_batch_size(x) // self.data_parallel
        schedules.check_microbatches(row, count)
        parts = [
            batch_part(x, d * count + m, row // count)
            for d in range(self.data_parallel)
            for m in range(count)
        ]
        return [
            [
                parts[(r // self.tensor_parallel) * count + m]
                for r in range(self.data_parallel * self.tensor_parallel)
            ]
            for m in range(count)
        ]

    def _microbatches(self, x, y):
        # Per micro-batch, the last stage's replicas' gradients of the
        # loss with respect to their outputs.
        self._loss_cotangents = {}
        received = {(0, m): part for m, part in enumerate(self._per_replica(x))}
        return received, self._per_replica(y)

    def _started(self):
        """The start time of the action issued now: a replica's work
        waits for it, which waits for the action's inputs and its
        stage's previous action (see `_timed`). Replicas run in threads
        of their own, which the control dependencies of the thread that
        issues them do not reach."""
        return self.times[-1][0]

    def _run_forward(self, stage, m, received, target):
        runtime = self.runtimes[stage]
        model = self.stage_models[stage]
        started = self._started()

        def forward():
            replica = runtime._replica_id()
            with tf.control_dependencies([started]):
                inputs = tf.nest.map_structure(tf.identity, received[replica])
            with tf.GradientTape() as tape:
                tape.watch(floating(inputs))
                with runtime.sequence_shards():
                    outputs = runtime.whole_outputs(
                        model(inputs, training=True)
                    )
            self._tapes[stage, m, replica] = (tape, inputs, outputs)
            return outputs

        outputs = self._replica_results(stage, forward)
        if target is None:
            return outputs, None
        return self._row_losses(m, outputs, target), outputs

    def _row_losses(self, m, outputs, target):
        """Each data-parallel row's share of the batch's loss from its
        outputs of micro-batch `m`, computed outside the replicas (where
        Keras would divide a loss by their number); the gradient of each
        row's loss with respect to its outputs is kept for the backward
        passes of the row's replicas."""
        losses, cotangents = [], []
        for first in range(0, len(outputs), self.tensor_parallel):
            predicted = floating(outputs[first])
            with tf.GradientTape() as tape:
                tape.watch(predicted)
                loss = self.loss(target[first], outputs[first])
                loss = loss / self.num_microbatches
            losses.append(loss)
            cotangents.append(
                tape.gradient(
                    loss,
                    predicted,
                    unconnected_gradients=tf.UnconnectedGradients.ZERO,
                )
            )
        self._loss_cotangents[m] = [
            cotangents[r // self.tensor_parallel] for r in range(len(outputs))
        ]
        return losses

    def _run_backward(self, stage, m, cotangent):
        runtime = self.runtimes[stage]
        variables = self.stage_models[stage].trainable_variables
        started = self._started()
        if cotangent is None:
            cotangent = self._loss_cotangents.pop(m)

        def backward():
            replica = runtime._replica_id()
            tape, inputs, outputs = self._tapes.pop((stage, m, replica))
            sources = floating(inputs) if stage else []
            with tf.control_dependencies([started]):
                grads = tape.gradient(
                    floating(outputs),
                    [*variables, *sources],
                    output_gradients=cotangent[replica],
                )
            self._accumulate(
                stage, variables, grads[: len(variables)], (stage, replica)
            )
            # An input the outputs do not depend on gets a zero gradient:
            # a replica returns tensors only.
            sent = [
                tf.zeros_like(source) if g is None else g
                for source, g in zip(sources, grads[len(variables) :])
            ]
            return sent, self.gradients[stage, replica]

        results = self._replica_results(stage, backward)
        return [r[0] for r in results], tf.nest.flatten(results)

    def _joined(self, losses, predictions):
        # Each row's loss is the mean over its equal slice of the batch,
        # so their mean is the batch's.
        loss = tf.add_n([row for micro in losses for row in micro])
        return loss / self.data_parallel, self._batch_outputs(predictions)

    def _batch_outputs(self, predictions):
        """The batch's outputs from each micro-batch's, per replica: row
        by row (from its first replica), each row's micro-batches in
        order."""
        return concatenated(
            [
                micro[r]
                for r in range(0, len(predictions[0]), self.tensor_parallel)
                for micro in predictions
            ]
        )

    def _call_stage(self, stage, values, training):
        """Each replica's outputs of `stage` on its structure of `values`."""
        runtime = self.runtimes[stage]
        model = self.stage_models[stage]

        def call():
            with runtime.sequence_shards():
                return runtime.whole_outputs(
                    model(values[runtime._replica_id()], training=training)
                )

        return self._replica_results(stage, call)

    def forward(self, x, training=False):
        """The stages' outputs for a batch, one micro-batch after the other,
        each data-parallel row on its slice.

        Args:
            x: the batch's inputs, of a known batch size.
            training: the `training` argument of the stages' calls.

        Returns:
            The last stage's outputs of the whole batch.
        """
        predictions = []
        for values in self._per_replica(x):
            for stage in range(len(self.stage_models)):
                if stage:
                    self._send(values, "forward")
                values = self._call_stage(stage, values, training)
            predictions.append(values)
        return self._batch_outputs(predictions)


class _StageTrainer:
    """What a stage's `TensorFlowRuntime` reads of the model it trains
    (`prepare_optimizer`, the local shapes of a replica, the statistics
    averaged over `data`): the stage's variables, and its own optimizer,
    which updates the trainable ones the stage owns.

    Args:
        model: the stage's Keras model.
        optimizer: the stage's optimizer.
        owned: the stage's trainable variables that no earlier stage
            owns.
    """

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


class SplitStagesRuntime(TensorFlowPipelineRuntime):
    """`PipelineRuntime` whose stages each run on a `TensorFlowRuntime`.

    Stage `s` of replica `d` runs on its `T` devices `stage_devices[s][d
    * T : (d + 1) * T]`; the stage's runtime holds the `D x T` devices of
    every replica. See the module docstring.

    Args: those of `PipelineRuntime`.

    Attributes:
        stage_runtimes: the `TensorFlowRuntime` of each stage.
        stage_optimizers: each stage's optimizer, made from the compiled
            one the first time the model trains (`build_optimizer`).
    """

    # Each replica runs the code between the split layers on its own
    # values, so `auto_plan` checks the plan for that.
    local_ranks = True
    # Each stage's runtime runs it, whatever its data axis; the stages
    # exchange whole activations.
    sequence_parallel_stages = True
    sequence_parallel_replicas = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Each collective is issued by every replica of its stage, and
        # counted once, by the stage's first replica.
        self.stats = ReplicaStats()
        for model in self.stage_models[1:]:
            model.input_spec = [_any_size(spec) for spec in model.input_spec]
        self.stage_runtimes = self.stage_runtimes_of(TensorFlowRuntime)
        self.stage_optimizers = []
        # The compiled optimizer the stage optimizers were made from.
        self._optimizers_of = None
        # By `(stage, id(variable))`, a later stage's copy of a weight an
        # earlier stage owns (a tied embedding), stored on its replicas.
        self._copies = {}
        self._shared_variables = {}

    def prepare_model(self, model):
        """Nothing to mirror: each stage's runtime holds its replicas."""

    def _owner(self, variable):
        return self.stage_runtimes[self.stage_of[id(variable)]]

    def place_variable(self, variable, axis):
        """Places `variable` on its owner's replicas; the later stages
        that use it get a copy of its pieces on theirs."""
        owner = self.stage_of[id(variable)]
        for stage in self.shared_stages.get(id(variable), ()):
            if stage != owner:
                runtime = self.stage_runtimes[stage]
                runtime.placement.borrow(variable, axis)
                self._copies[stage, id(variable)] = runtime.storage_copy(
                    variable, axis
                )
                self._shared_variables[id(variable)] = variable
        self._owner(variable).placement.place(variable, axis)

    def calling_stage_runtime(self, stages):
        runtimes = {s: self.stage_runtimes[s] for s in stages}

        def calling():
            # The stage whose replicas run now.
            return next(
                (s for s, runtime in runtimes.items() if runtime._in_replica()),
                None,
            )

        return CallingStageRegions(runtimes, calling)

    @contextlib.contextmanager
    def reading_copies(self, stage):
        """Makes the weights `stage` uses but does not own read its copies
        of them (see `refresh_copies`), for the replica steps issued
        inside: their reads, and the gradients of those reads."""
        swapped = [
            (variable, stored_value(variable))
            for variable in self.stage_models[stage].weights
            if (stage, id(variable)) in self._copies
        ]
        for variable, _ in swapped:
            set_stored_value(variable, self._copies[stage, id(variable)])
        try:
            yield
        finally:
            for variable, owned in swapped:
                set_stored_value(variable, owned)

    def refresh_copies(self):
        """Copies each shared weight's pieces from its owner's replicas to
        the stages that also use it, replica `(d, t)` to replica `(d, t)`,
        once a step (counted as sent on `"pipe"`)."""
        for (stage, key), copy in self._copies.items():
            owned = stored_value(self._shared_variables[key]).values
            runtime = self.stage_runtimes[stage]

            def refresh(copy=copy, owned=owned, runtime=runtime):
                copy.assign(owned[runtime._replica_id()].read_value())
                # `strategy.run` needs a result to return.
                return tf.zeros(())

            runtime.replica_results(refresh, self.stage_models[stage])
            for piece in owned:
                self.stats.record("send", nbytes(piece), "forward", "pipe")

    def place_variable_like(self, variable, reference, data_axis):
        self.stage_of[id(variable)] = self.stage_of[id(reference)]
        self._owner(variable).placement.place_like(
            variable, reference, data_axis
        )

    def full_value(self, variable):
        return self._owner(variable).full_value(variable)

    def assign_full_value(self, variable, value):
        self._owner(variable).assign_full_value(variable, value)

    def _storing_runtime(self, variable):
        """The stage runtime that stores `variable` (a model variable, or
        a slot of a stage's optimizer); `None` for the compiled
        optimizer's own variables, whole on the host."""
        stage = self.stage_of.get(id(variable))
        if stage is not None:
            return self.stage_runtimes[stage]
        return next(
            (r for r in self.stage_runtimes if r.placement.is_placed(variable)),
            None,
        )

    def local_pieces(self, variable):
        """The pieces of `variable` its stage's replicas hold, each in
        the file of its stage and replica."""
        runtime = self._storing_runtime(variable)
        if runtime is None:
            # The compiled optimizer's own: with the first replica's.
            whole = tuple((0, int(n)) for n in variable.shape)
            value = keras.ops.convert_to_numpy(variable.value)
            return [("stage0-replica0", whole, value)]
        stage = self.stage_runtimes.index(runtime)
        return [
            (f"stage{stage}-{writer}", index, array)
            for writer, index, array in runtime.local_pieces(variable)
        ]

    def assign_local_pieces(self, variable, read):
        """Assigns the pieces of `variable` its stage's replicas hold (a
        shared weight's copies follow at the next step)."""
        runtime = self._storing_runtime(variable)
        if runtime is None:
            variable.assign(read(tuple((0, int(n)) for n in variable.shape)))
        else:
            runtime.assign_local_pieces(variable, read)

    def save_model(self, model, filepath, **kwargs):
        """Writes the unsplit `model` (Keras' own save) with each stage's
        variables assembled on the host for the time of the write."""
        with contextlib.ExitStack() as assembled:
            for stage, runtime in enumerate(self.stage_runtimes):
                owned = [
                    v
                    for v in model.variables
                    if self.stage_of.get(id(v)) == stage
                ]
                assembled.enter_context(runtime._assembled(owned))
            model.save(filepath, **kwargs)

    def checkpoint_optimizer_state(self, optimizer):
        """`[(key, variable)]` of the optimizer state, keyed as one
        device's optimizer keys it (`optimizer/i`), so that a checkpoint
        loads at any layout: the compiled optimizer's own variables (its
        step count and learning rate, which every stage's optimizer takes
        each step), then each trainable variable's slots, from the stage
        that owns it, in the model's order of the trainable variables.

        Raises:
            ValueError: for an optimizer that does not make each variable's
                slots one after the other (`stage_slots`).
        """
        self.build_optimizer(self.trainer)
        slots = {}
        for stage, runtime in zip(self.stage_optimizers, self.stage_runtimes):
            inner = stage.optimizer
            if isinstance(inner, CoordinatedOptimizer):
                # The pipeline's CoordinatedOptimizers keep no state of
                # their own: the step count and the learning rate are the
                # inner optimizer's.
                inner = inner.inner_optimizer
            slots.update(stage_slots(inner, runtime.placement.references))
        trainable = self.trainer.trainable_variables
        counts = {
            position: len(slots[id(v)])
            for position, v in enumerate(trainable)
            if id(v) in slots
        }
        return one_device_keys(trainable, optimizer.variables, slots, counts)

    def device_bytes(self, variables):
        """`{device: bytes}` of these variables, from every stage's
        runtime (each reads the variables it owns), and of the later
        stages' copies of shared weights."""
        totals = dict.fromkeys(self.devices, 0)
        for stage, runtime in enumerate(self.stage_runtimes):
            placed = [
                v
                for v in variables
                if runtime.placement.is_placed(v)
                and self.stage_of.get(id(v), stage) == stage
            ]
            for device, size in runtime.device_bytes(placed).items():
                totals[device] = totals.get(device, 0) + size
        for variable in variables:
            for stage in self.shared_stages.get(id(variable), ()):
                copy = self._copies.get((stage, id(variable)))
                for piece in copy.values if copy is not None else ():
                    totals[device_name(piece.device)] += nbytes(piece)
        return totals

    def check_compiled(self, trainer):
        super().check_compiled(trainer)
        # Each stage updates its variables with a copy of this optimizer
        # (`build_optimizer`): built on no variable, it keeps the step
        # count and holds no slot.
        if not trainer.optimizer.built:
            trainer.optimizer.build([])

    def build_optimizer(self, trainer):
        """Makes each stage's optimizer from the compiled one, once per
        compile, and builds its slots with the stage's variables."""
        optimizer = trainer.optimizer
        if self._optimizers_of is optimizer:
            return
        # The first step may make them while Keras traces it: they are
        # made eagerly, to outlive the trace.
        with tf.init_scope():
            if not optimizer.built:
                optimizer.build([])
            config = optimizer.get_config()
            self.stage_optimizers = [
                self._stage_trainer(type(optimizer).from_config(config), s)
                for s in range(self.pipeline_parallel)
            ]
        self._optimizers_of = optimizer

    def _stage_trainer(self, optimizer, stage):
        """Stage `stage`'s `_StageTrainer`, whose optimizer is `optimizer`
        (a copy of the compiled one), built on the stage's variables."""
        runtime = self.stage_runtimes[stage]
        if runtime.optimizer_runtime is None:
            place_slots_on_creation(optimizer, runtime.placement.place_like)
        else:
            optimizer = CoordinatedOptimizer(
                optimizer, zero_stage=self.zero_stage
            )
            runtime.bind_optimizer(optimizer)
        model = self.stage_models[stage]
        owned = [
            v
            for v in model.trainable_variables
            if self.stage_of[id(v)] == stage
        ]
        trainer = _StageTrainer(model, optimizer, owned)
        prepare_optimizer(runtime, trainer)
        return trainer

    def _make_runners(self, count):
        return [
            SplitStagesPipeline(
                self.stage_models,
                self.stage_runtimes,
                self._loss,
                self.schedule,
                count,
                self.stats,
                self.reading_copies if self._copies else None,
            )
        ]

    def run_step(self, phase, step, *args, **kwargs):
        # The collective groups of a stage's `data` axis run in graphs
        # only: an eager step (`run_eagerly=True`) is traced anew.
        step_of = getattr(self, f"{phase}_step")
        if tf.executing_eagerly():
            step_of = tf.function(step_of)
        with self.stats.recording(phase):
            return step_of(*args, **kwargs)

    def train_step(self, data):
        """Keras' train step: the schedule over the stages' replicas, then
        each stage's update on its replicas.

        Args:
            data: the batch, `(x, y)`.

        Returns:
            The metrics' logs, as Keras' `train_step` returns them.
        """
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        self.check_no_sample_weight(sample_weight)
        self.build_optimizer(self.trainer)
        (runner,) = self._runners_of(x)
        self.refresh_copies()
        loss, y_pred = runner.step(x, y)
        self._record_step(runner)
        addends = self._owned_gradients(runner.gradients)
        for index, (runtime, stage) in enumerate(
            zip(self.stage_runtimes, self.stage_optimizers)
        ):
            self._update(index, runtime, stage, addends)
        self.trainer.optimizer.iterations.assign_add(1)
        update_loss_tracker(self.trainer, loss, traced_batch_size(x))
        return self.trainer.compute_metrics(x, y, y_pred, None)

    def _owned_gradients(self, gradients):
        """By `(stage, replica)`, per variable the stage owns, the
        gradients to add up for its update: its own and, for a weight
        later stages also use (a tied embedding), theirs, sent from their
        replica `(d, t)` to the owner's (counted on `"pipe"`), as
        Megatron-LM all-reduces its word embeddings' gradients between its
        first and last stages.

        Args:
            gradients: `SplitStagesPipeline.gradients`.
        """
        addends = {}
        for (stage, replica), grads in gradients.items():
            variables = self.stage_models[stage].trainable_variables
            for variable, grad in zip(variables, grads):
                owner = self.stage_of[id(variable)]
                if owner != stage:
                    self.stats.record("send", nbytes(grad), "backward", "pipe")
                addends.setdefault((owner, replica, id(variable)), []).append(
                    grad
                )
        return {
            (owner, replica): [
                addends[owner, replica, id(v)]
                for v in self.stage_optimizers[owner].trainable_variables
            ]
            for owner, replica, _ in addends
        }

    def _update(self, index, runtime, stage, addends):
        """Stage `index`'s update on each of its replicas, from the sums of
        the replica's gradients (`_owned_gradients`), made there.

        The stage's optimizer first takes the compiled one's step count
        and learning rate: a callback (`ReduceLROnPlateau`) or a load sets
        those of the compiled optimizer.
        """
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
        (runner,) = self._runners_of(x)
        self.refresh_copies()
        return runner.forward(x, training)

    def call_model(self, model, inputs, training):
        """A direct call (`tp(x)`); under sequence parallelism it runs as
        `predict`'s steps do, since sequence shards exist only in the
        stages' replica steps."""
        if not self.sequence_parallel:
            return super().call_model(model, inputs, training)
        forward = self._forward
        if tf.executing_eagerly():
            forward = tf.function(forward)
        with self.stats.recording("call"):
            return forward(inputs, bool(training))


def _any_size(spec):
    """`spec` checking the rank only: a stage's replica receives its
    piece of an activation the previous stage's split layer leaves split
    (a Column layer's features), and Keras would check the whole width."""
    return keras.InputSpec(
        dtype=spec.dtype,
        ndim=spec.ndim,
        allow_last_axis_squeeze=spec.allow_last_axis_squeeze,
        name=spec.name,
        optional=spec.optional,
    )
