"""The stage primitives of JAX pipelines: each stage's compiled passes.

A stage's forward pass is a jitted `jax.vjp` of the stage's Keras model on
its devices; it returns the stage's outputs and the residuals (the
activations) its backward pass needs, which live from a micro-batch's
forward pass to its backward pass, so a 1F1B order holds fewer of them
than GPipe's. `StagePrograms` compiles the passes and `JaxStages` serves
them to the pipeline's executor (`keras_tp.pipeline.executor`) on one
step's values: Python issues them in the schedule's order, and JAX's
asynchronous dispatch lets the devices of different stages compute at the
same time (an array sent to the next stage's devices is copied when it is
ready).
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

from keras_tp.keras_internals import local_shapes
from keras_tp.pipeline import schedules
from keras_tp.pipeline.executor import StagePrimitives
from keras_tp.tensors import is_float

# The index of the stage whose program is being traced in this context.
TRACING_STAGE = contextvars.ContextVar("keras_tp_tracing_stage", default=None)
# Per-device values that cross between programs, one row per device of a
# `data x model` mesh: device (d, t) of one stage sends its row to device
# (d, t) of the next.
ROWS = PartitionSpec(("data", "model"))
DATA = PartitionSpec("data")


def onto(tree, mesh):
    """The arrays of `tree` placed on `mesh`, each keeping its split.

    An activation split over the sending stage's `model` axis (a Column
    layer's output) goes to the same split on the receiving stage: each
    device sends its shard to its counterpart. Other arrays arrive whole
    on every device of the stage.
    """

    def put(array):
        sharding = getattr(array, "sharding", None)
        named = isinstance(sharding, NamedSharding)
        spec = sharding.spec if named else PartitionSpec()
        return jax.device_put(array, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map(put, tree)


class StageClock:
    """When each stage's programs ran on its devices.

    Python issues a JAX pipeline's passes asynchronously, so when each one
    ran is known on its devices only. Each training pass is stamped
    (`stamped`) by two host callbacks in its program: one that its
    computation waits for, once its inputs are there, and one once its
    outputs are. A stage's programs run one after another on its devices,
    in the order they were issued, so its stamps pair up with its actions
    in the schedule's order (only the last step's are kept).
    """

    def __init__(self, num_stages, num_microbatches):
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
        seen = records.get(signature(args))
        outputs = compiled(*args)
        if seen is not None:
            stats.replay(seen)
        return outputs

    return call


def signature(tree):
    """The shapes and dtypes of a tree's leaves: what a trace depends on."""
    return tuple(
        (getattr(leaf, "shape", None), str(getattr(leaf, "dtype", type(leaf))))
        for leaf in jax.tree_util.tree_leaves(tree)
    )


def count_received(stats, tree, direction):
    """Counts, one call per array, what a stage's devices received from
    their neighbour, placed on them: each device its own shard or copy.
    Integer inputs' `float0` gradients carry no data."""
    for leaf in jax.tree_util.tree_leaves(tree):
        if leaf.dtype != jax.dtypes.float0:
            received = sum(s.data.nbytes for s in leaf.addressable_shards)
            stats.record("send", received, direction, "pipe")


def batch_size(tree):
    return len(jax.tree_util.tree_leaves(tree)[0])


class StagePrograms:
    """Each stage's compiled passes: on whole arrays, or per device.

    On whole arrays (`per_device=False`: stages without replicas, and
    direct calls `tp(x)` on any batch) each pass is jitted on global
    arrays, and the stage's split layers are `shard_map` regions.

    Per device (`per_device=True`: stages with replicas) each pass runs
    inside one `shard_map` over the stage's `data x model` mesh, as a
    data-parallel step does (`keras_tp.runtime.jax.steps`). Replica `d`
    (row `d` of every stage's mesh) trains on the `d`-th slice of each
    batch, in `num_microbatches` micro-batches, as a torch replica does: a
    micro-batch's arrays hold every replica's slice, split over `data`.
    Values that cross between programs (activations, their gradients,
    residuals) travel as one row per device (`ROWS`), so no program needs
    to know how each is split; the gradients leave with one row per
    replica (`"data"` on a new first axis), summed over the micro-batches
    on their devices without communication, and the replicas combine them
    once per step in the stage's optimizer update.

    Both are built by the same code: on whole arrays the rows and the
    `shard_map` are the identity. Residuals that are a pass's own inputs
    (the weights, the incoming activations) are not copied out: the
    backward pass takes those inputs again and puts them back in place.
    A stage differentiates its float inputs only (an integer padding mask
    passes through without a gradient).

    Args:
        stage_models: the Keras model of each stage, in order.
        runtimes: the `JaxRuntime` of each stage's devices.
        stats: the pipeline's `CommunicationStats`.
        per_device: whether the passes run per device (see above).
        loss: the loss of `(y_true, y_pred)`, averaged over a micro-batch;
            `None` for programs that only run inference (`infer`).
        num_microbatches: micro-batches per batch of a training step.
    """

    def __init__(
        self,
        stage_models,
        runtimes,
        stats,
        per_device,
        loss=None,
        num_microbatches=None,
    ):
        self.stage_models = list(stage_models)
        self.runtimes = list(runtimes)
        self.stats = stats
        self.per_device = per_device
        self.replicas = runtimes[0].data_parallel if per_device else 1
        self.loss = loss
        self.num_microbatches = num_microbatches
        self.last = len(self.stage_models) - 1
        self.clock = StageClock(len(stage_models), num_microbatches or 1)
        self._programs = {}
        # Per forward trace, how to rebuild its VJP from kept residuals.
        self._layouts = {}
        self._tracing = None

    def split_batch(self, tree, count):
        """The batch's `count` micro-batches: micro-batch `m` holds the
        `m`-th slice of each replica's part of the batch, replica by
        replica."""
        replicas = self.replicas
        size = batch_size(tree) // (replicas * count)

        def part(array, m):
            array = array.reshape((replicas, count, size) + array.shape[1:])
            return array[:, m].reshape((replicas * size,) + array.shape[3:])

        return [
            jax.tree_util.tree_map(lambda a, m=m: part(a, m), tree)
            for m in range(count)
        ]

    def join_batch(self, parts):
        """The micro-batches' outputs as the batch's (see `split_batch`)."""
        replicas = self.replicas

        def whole(*leaves):
            stacked = jax.numpy.stack(leaves)
            count, rows = stacked.shape[:2]
            stacked = stacked.reshape(
                (count, replicas, rows // replicas) + stacked.shape[2:]
            ).swapaxes(0, 1)
            return stacked.reshape((count * rows,) + stacked.shape[3:])

        return jax.tree_util.tree_map(whole, *parts)

    def batch_loss(self, total):
        """Each replica's loss is its slice's; the batch's is their mean."""
        return jax.numpy.mean(total)

    def place(self, stage, tree):
        """A stage's input arrays, placed on its devices: the first
        stage's split over its replicas when per device."""
        mesh = self.runtimes[stage].mesh
        if stage or not self.per_device:
            return onto(tree, mesh)
        sharding = NamedSharding(mesh, DATA)
        return jax.tree_util.tree_map(
            lambda a: jax.device_put(a, sharding), tree
        )

    def infer(self, stage, trainable, non_trainable, inputs):
        """A stage's forward pass of one micro-batch, for inference.

        Returns:
            `(outputs, its new non-trainable values)`.
        """
        program = self._program(("infer", stage), stage, self._inference_of)
        return program(trainable, non_trainable, self.place(stage, inputs))

    def forward(self, stage, trainable, non_trainable, inputs, targets):
        """Runs a stage's forward pass of one micro-batch.

        Returns:
            `(outputs, residuals, non_trainable, predictions)`: the stage's
            outputs (on the last stage, its share of the batch's loss, one
            per replica), what its backward pass takes, its new
            non-trainable values and, on the last stage, its outputs.
        """
        args = (trainable, non_trainable, self.place(stage, inputs), targets)
        self._tracing = key = (stage, signature(args))
        program = self._program(
            ("forward", stage), stage, self._forward_of, True
        )
        outputs, kept, new_non_trainable, predictions = program(*args)
        return outputs, (key, args, kept), new_non_trainable, predictions

    def backward(self, stage, residuals, cotangent):
        """`(gradients, input gradients)` of a stage's micro-batch;
        `cotangent` is the gradient of its outputs (`None` on the last)."""
        key, args, kept = residuals
        program = self._program(
            ("backward", key),
            stage,
            lambda s: self._backward_of(s, *self._layouts[key]),
            stamped=True,
        )
        return program(*args, kept, cotangent)

    def _program(self, key, stage, make, stamped=False):
        """The compiled program `key` of `stage`, made by `make(stage)` once;
        a training pass stamps when it ran (`StageClock`)."""
        if key not in self._programs:
            function = make(stage)
            if stamped:
                function = self.clock.stamped(function, stage)
            self._programs[key] = counted_jit(function, self.stats)
        return self._programs[key]

    def _mapped(self, stage, local, in_specs, out_specs):
        """`local` per device on the stage's mesh; whole, as it is."""
        if not self.per_device:
            return local
        return jax.shard_map(
            local,
            mesh=self.runtimes[stage].mesh,
            in_specs=in_specs,
            out_specs=out_specs,
            check_vma=False,
        )

    def _rows(self, tree):
        if not self.per_device:
            return tree
        return jax.tree_util.tree_map(lambda a: a[None], tree)

    def _from_rows(self, tree):
        if not self.per_device:
            return tree
        return jax.tree_util.tree_map(lambda a: a[0], tree)

    def _specs(self, stage):
        """`(trainable, non_trainable, inputs, targets)` in-specs."""
        spec = self.runtimes[stage]._variable_spec
        model = self.stage_models[stage]
        return (
            [spec(v) for v in model.trainable_variables],
            [spec(v) for v in model.non_trainable_variables],
            ROWS if stage else DATA,
            DATA,
        )

    @contextlib.contextmanager
    def _traced(self, stage):
        """Marks the tracing of `stage`'s program (a layer that several
        stages call runs its split part on this stage's devices); per
        device, its variables report their local shapes and its regions
        run on local values."""
        token = TRACING_STAGE.set(stage)
        runtime = self.runtimes[stage]
        placement = runtime.placement
        placed = [
            v
            for v in self.stage_models[stage].variables
            if self.per_device and placement.is_placed(v)
        ]
        ranks = (
            runtime._ranks() if self.per_device else contextlib.nullcontext()
        )
        try:
            with local_shapes(placed, placement.local_shape), ranks:
                yield
        finally:
            TRACING_STAGE.reset(token)

    def _inference_of(self, index):
        model = self.stage_models[index]
        last = index == self.last

        def local(trainable, non_trainable, inputs):
            inputs = self._from_rows(inputs) if index else inputs
            with self._traced(index):
                outputs, new_non_trainable = model.stateless_call(
                    trainable, non_trainable, inputs, training=False
                )
            return (outputs if last else self._rows(outputs)), new_non_trainable

        specs = self._specs(index)
        out_specs = (DATA if last else ROWS, specs[1])
        return self._mapped(index, local, specs[:3], out_specs)

    def _forward_of(self, index):
        model = self.stage_models[index]
        last = index == self.last

        def local(trainable, non_trainable, inputs, targets):
            inputs = self._from_rows(inputs) if index else inputs
            candidates = jax.tree_util.tree_leaves(
                (trainable, non_trainable, inputs, targets)
            )
            floats, rebuild = _floats(inputs)

            def stage(trainable, floats):
                outputs, new_non_trainable = model.stateless_call(
                    trainable, non_trainable, rebuild(floats), training=True
                )
                if not last:
                    return _floats(outputs)[0], (new_non_trainable, outputs)
                # Each micro-batch's share of the batch's mean loss; the
                # predictions ride along for the metrics.
                loss = self.loss(targets, outputs) / self.num_microbatches
                return loss, (new_non_trainable, outputs)

            with self._traced(index):
                primal, vjp, (new_non_trainable, outputs) = jax.vjp(
                    stage, trainable, floats, has_aux=True
                )
            residuals, treedef = jax.tree_util.tree_flatten(vjp)
            index_of = {id(leaf): i for i, leaf in enumerate(candidates)}
            sources = tuple(index_of.get(id(leaf)) for leaf in residuals)
            self._layouts[self._tracing] = (treedef, sources)
            kept = [r for r, s in zip(residuals, sources) if s is None]
            if last:
                sent, predictions = self._rows(primal), outputs
            else:
                sent, predictions = self._rows(outputs), None
            return sent, self._rows(kept), new_non_trainable, predictions

        specs = self._specs(index)
        # The last stage's share of the loss and its outputs (the
        # predictions) are whole on each replica's devices.
        out_specs = (
            DATA if last else ROWS,
            ROWS,
            specs[1],
            DATA if last else None,
        )
        return self._mapped(index, local, specs, out_specs)

    def _backward_of(self, index, treedef, sources):
        last = index == self.last

        def local(trainable, non_trainable, inputs, targets, kept, cotangent):
            inputs = self._from_rows(inputs) if index else inputs
            candidates = jax.tree_util.tree_leaves(
                (trainable, non_trainable, inputs, targets)
            )
            kept = iter(self._from_rows(kept))
            vjp = jax.tree_util.tree_unflatten(
                treedef,
                [next(kept) if s is None else candidates[s] for s in sources],
            )
            gradients, input_gradients = vjp(
                np.float32(1.0) if last else self._from_rows(cotangent)
            )
            return (
                self._rows(gradients),
                self._rows(input_gradients) if index else None,
            )

        runtime = self.runtimes[index]
        variables = self.stage_models[index].trainable_variables
        out_specs = (replica_rows(runtime, variables), ROWS)
        return self._mapped(
            index, local, (*self._specs(index), ROWS, ROWS), out_specs
        )


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
            inputs,
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
            stage, self.trainable[stage], self.non_trainable[stage], inputs
        )
        return outputs

    def joined(self, losses, predictions):
        return (
            self.programs.batch_loss(sum(losses[1:], losses[0])),
            self.programs.join_batch(predictions),
        )


def replica_rows(runtime, variables):
    """Per variable, its placement with one row per replica first."""
    return [
        PartitionSpec("data", *runtime._variable_spec(v)) for v in variables
    ]


def _floats(tree):
    """`(float leaves, rebuild)`: a tree's differentiable leaves, and the
    function that puts new ones back among its other leaves."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    floats = [is_float(leaf) for leaf in leaves]

    def rebuild(new_floats):
        new = iter(new_floats)
        return jax.tree_util.tree_unflatten(
            treedef,
            [next(new) if f else leaf for leaf, f in zip(leaves, floats)],
        )

    return [leaf for leaf, f in zip(leaves, floats) if f], rebuild
