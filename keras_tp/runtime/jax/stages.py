"""The stage primitives of JAX pipelines: each stage's compiled passes.

A stage's forward pass returns its outputs and what its backward pass
needs (its residuals); its backward pass takes those and the gradient of
its outputs. `StagePrograms` compiles them for a stage of one device, or
of several that split its layers by tensor parallelism: each pass is a
jitted `jax.vjp` on whole arrays, whose split layers are `shard_map`
regions (`keras_tp.runtime.jax.replicated_stages` has the stages with
replicas). `JaxStages` serves them to the pipeline's executor
(`keras_tp.pipeline.executor`) as its stage primitives, on one step's
values: Python issues the passes in the schedule's order, and JAX's
asynchronous dispatch lets the devices of different stages compute at
the same time.
"""

import collections
import contextlib
import contextvars
import time

import jax
import jax.experimental
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from keras_tp.pipeline import schedules
from keras_tp.pipeline.executor import StagePrimitives

# The index of the stage whose program is being traced in this context.
TRACING_STAGE = contextvars.ContextVar("keras_tp_tracing_stage", default=None)


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


@contextlib.contextmanager
def tracing_stage(index):
    """Marks the tracing of stage `index`'s program: a layer that several
    stages call runs its split part on that stage's devices."""
    token = TRACING_STAGE.set(index)
    try:
        yield
    finally:
        TRACING_STAGE.reset(token)


class StageClock:
    """When each stage's programs ran on its devices.

    Python issues a JAX pipeline's passes asynchronously, so when each one
    ran is known on its devices only. Each training pass is stamped
    (`stamped`) by two host callbacks in its program: one that its
    computation waits for, once its inputs are there, and one once its
    outputs are. A stage's programs run one after another on its devices,
    in the order they were issued, so its stamps pair up with its actions
    in the schedule's order.

    Args:
        num_stages: the pipeline's stages.
        num_microbatches: micro-batches per training step.
    """

    def __init__(self, num_stages, num_microbatches):
        # A step's stamps of a stage: a start and an end of a forward and
        # a backward pass per micro-batch; only the last step's are kept.
        self.stamps = [
            collections.deque(maxlen=4 * num_microbatches)
            for _ in range(num_stages)
        ]

    def stamped(self, function, stage):
        """`function`, whose program stamps its start and end on `stage`'s
        clock."""

        def stamped_function(*args):
            start = self._stamp(stage, args)
            args, _ = jax.lax.optimization_barrier((args, start))
            outputs = function(*args)
            self._stamp(stage, outputs)
            return outputs

        return stamped_function

    def _stamp(self, stage, tree):
        # A first element of every array makes the callback wait for all.
        firsts = [
            leaf.ravel()[:1]
            for leaf in jax.tree_util.tree_leaves(tree)
            if hasattr(leaf, "ravel")
            and leaf.size
            and leaf.dtype != jax.dtypes.float0
        ]

        def record(*_):
            self.stamps[stage].append(time.perf_counter())
            return np.int32(0)

        return jax.experimental.io_callback(
            record, jax.ShapeDtypeStruct((), np.int32), *firsts
        )

    def timeline(self, order):
        """The `schedules.Timeline` of the last step whose actions were
        `order`, once its programs have run."""
        jax.effects_barrier()
        records = []
        for stage, stamps in enumerate(self.stamps):
            actions = [(kind, m) for s, kind, m in order if s == stage]
            stamps = list(stamps)
            records.append(
                [
                    (kind, m, stamps[2 * i], stamps[2 * i + 1])
                    for i, (kind, m) in enumerate(actions)
                ]
            )
        return schedules.recorded_timeline(records)


def counted_jit(function, stats):
    """`jax.jit(function)` whose collectives count at every call.

    A region's collectives are recorded while the function is traced,
    once per input signature; each later call records them again.
    """
    records = {}

    def traced(*args):
        with stats.capturing() as added:
            outputs = function(*args)
        records[signature(args)] = added
        return outputs

    compiled = jax.jit(traced)

    def call(*args):
        key = signature(args)
        seen = key in records
        outputs = compiled(*args)
        if seen:
            stats.replay(records[key])
        return outputs

    return call


def signature(tree):
    """The shapes and dtypes of a tree's leaves: what a trace depends on."""
    return tuple(
        (getattr(leaf, "shape", None), str(getattr(leaf, "dtype", type(leaf))))
        for leaf in jax.tree_util.tree_leaves(tree)
    )


def microbatch(tree, m, size):
    """The `m`-th slice of `size` samples of every array of `tree`."""
    return jax.tree_util.tree_map(lambda a: a[m * size : (m + 1) * size], tree)


def concatenated(parts):
    """The micro-batches' outputs joined back into the batch's."""
    return jax.tree_util.tree_map(
        lambda *leaves: jax.numpy.concatenate(leaves), *parts
    )


def count_received(stats, tree, direction):
    """Counts, one call per array, what a stage's devices received from
    their neighbour, placed on them: each device its own shard or copy.
    Integer inputs' `float0` gradients carry no data."""
    for leaf in jax.tree_util.tree_leaves(tree):
        if leaf.dtype != jax.dtypes.float0:
            received = sum(s.data.nbytes for s in leaf.addressable_shards)
            stats.record("send", received, direction, "pipe")


class StagePrograms:
    """Each stage's forward and backward pass, jitted on whole arrays.

    Args:
        stage_models: the Keras model of each stage, in order.
        runtimes: the `JaxRuntime` of each stage's devices.
        loss: the loss of `(y_true, y_pred)`, averaged over a micro-batch.
        num_microbatches: micro-batches per batch of a training step;
            `None` for programs that only run inference (`infer`).
        stats: the pipeline's `CommunicationStats`.
    """

    def __init__(self, stage_models, runtimes, loss, num_microbatches, stats):
        self.stage_models = list(stage_models)
        self.runtimes = list(runtimes)
        self.loss = loss
        self.num_microbatches = num_microbatches
        self.stats = stats
        self.clock = StageClock(len(stage_models), num_microbatches or 1)
        self._forwards = [
            counted_jit(
                self.clock.stamped(self._forward_of(index), index), stats
            )
            for index in range(len(stage_models))
        ]
        self._stage_backwards = [
            counted_jit(
                self.clock.stamped(
                    lambda vjp, cotangent: vjp(cotangent), index
                ),
                stats,
            )
            for index in range(len(stage_models))
        ]
        self._inferences = [
            counted_jit(self._inference_of(index), stats)
            for index in range(len(stage_models))
        ]

    data_parallel = 1

    @property
    def last(self):
        return len(self.stage_models) - 1

    def split_batch(self, tree, count):
        """The batch's `count` micro-batches, in order."""
        size = batch_size(tree) // count
        return [microbatch(tree, m, size) for m in range(count)]

    def join_batch(self, parts):
        """The micro-batches' outputs as the batch's (see `split_batch`)."""
        return concatenated(parts)

    def place(self, stage, tree):
        """A stage's input arrays, placed on its devices."""
        return onto(tree, self.runtimes[stage].mesh)

    def _forward_of(self, index):
        model = self.stage_models[index]
        last = index == self.last
        microbatches = self.num_microbatches

        def forward(trainable, non_trainable, inputs, targets):
            def stage(trainable, inputs):
                with tracing_stage(index):
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

    def _inference_of(self, index):
        model = self.stage_models[index]

        def forward(trainable, non_trainable, inputs):
            with tracing_stage(index):
                return model.stateless_call(
                    trainable, non_trainable, inputs, training=False
                )

        return forward

    def infer(self, stage, trainable, non_trainable, inputs):
        """A stage's forward pass of one micro-batch, for inference.

        Returns:
            `(outputs, its new non-trainable values)`.
        """
        return self._inferences[stage](trainable, non_trainable, inputs)

    def forward(self, stage, trainable, non_trainable, inputs, targets):
        """Runs a stage's forward pass of one micro-batch.

        Returns:
            `(outputs, residuals, non_trainable, predictions)`: the stage's
            outputs (on the last stage, its share of the batch's loss),
            what its backward pass takes, its new non-trainable values and,
            on the last stage, its outputs.
        """
        return self._forwards[stage](trainable, non_trainable, inputs, targets)

    def backward(self, stage, residuals, cotangent):
        """`(gradients, input gradients)` of a stage's micro-batch;
        `cotangent` is the gradient of its outputs (`None` on the last)."""
        if cotangent is None:
            cotangent = np.float32(1.0)
        return self._stage_backwards[stage](residuals, cotangent)

    def batch_loss(self, total):
        """The batch's loss from the sum of the last stage's shares."""
        return total


class JaxStages(StagePrimitives):
    """The stage primitives of a JAX pipeline: its compiled passes on the
    values of one step.

    Args:
        programs: the stages' compiled passes (`StagePrograms`).
        trainable: each stage's trainable values, on its devices.
        non_trainable: each stage's non-trainable values; `non_trainable`
            then holds their new values.
        count: the number of micro-batches.

    Attributes:
        gradients: after `run_schedule`, each stage's gradients summed over
            the micro-batches (of the mean loss; one row per replica with
            replicas).
    """

    def __init__(self, programs, trainable, non_trainable, count):
        self.programs = programs
        self.num_stages = len(programs.stage_models)
        self.trainable = trainable
        self.non_trainable = list(non_trainable)
        self.count = count
        self.gradients = [None] * self.num_stages
        self._residuals = {}

    def microbatches(self, x, y):
        split = self.programs.split_batch
        targets = None if y is None else split(y, self.count)
        return split(x, self.count), targets

    def forward(self, stage, m, inputs, target):
        (
            outputs,
            self._residuals[stage, m],
            self.non_trainable[stage],
            predicted,
        ) = self.programs.forward(
            stage,
            self.trainable[stage],
            self.non_trainable[stage],
            self.programs.place(stage, inputs),
            target,
        )
        return outputs, predicted

    def backward(self, stage, m, cotangent):
        grads, input_grads = self.programs.backward(
            stage, self._residuals.pop((stage, m)), cotangent
        )
        total = self.gradients[stage]
        self.gradients[stage] = (
            grads
            if total is None
            else jax.tree_util.tree_map(jax.numpy.add, total, grads)
        )
        return input_grads

    def send(self, value, stage, direction):
        value = onto(value, self.programs.runtimes[stage].mesh)
        count_received(self.programs.stats, value, direction)
        return value

    def infer(self, stage, inputs):
        outputs, self.non_trainable[stage] = self.programs.infer(
            stage,
            self.trainable[stage],
            self.non_trainable[stage],
            self.programs.place(stage, inputs),
        )
        return outputs

    def joined(self, losses, predictions):
        return (
            self.programs.batch_loss(sum(losses[1:], losses[0])),
            self.programs.join_batch(predictions),
        )


def batch_size(tree):
    return len(jax.tree_util.tree_leaves(tree)[0])
