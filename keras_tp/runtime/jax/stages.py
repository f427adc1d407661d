"""The stage primitives of JAX pipelines: `StagePrograms` compiles each
stage's passes, `JaxStages` serves them to the executor on one step's
values (asynchronous dispatch overlaps the stages), `StageClock` times
them on the devices."""

import collections
import contextlib
import contextvars
import time

import jax
import jax.experimental
import numpy as np
from jax.sharding import PartitionSpec

from keras_tp.collectives.jax import counted_jit
from keras_tp.collectives.jax import signature
from keras_tp.keras_internals import local_shapes
from keras_tp.pipeline.executor import StagePrimitives
from keras_tp.pipeline.executor import join_rows
from keras_tp.pipeline.executor import split_rows
from keras_tp.runtime.jax.storage import onto
from keras_tp.runtime.jax.storage import replica_rows
from keras_tp.tensors import carried_masks
from keras_tp.tensors import floats_of
from keras_tp.tensors import with_floats_replaced

# The index of the stage whose program is being traced in this context.
TRACING_STAGE = contextvars.ContextVar("keras_tp_tracing_stage", default=None)
# Per-device values that cross between programs, one row per device of a
# `data x model` mesh: device (d, t) of one stage sends its row to device
# (d, t) of the next.
ROWS = PartitionSpec(("data", "model"))
DATA = PartitionSpec("data")


class StagePrograms:
    """Each stage's compiled passes (`num_microbatches` is `None` for
    inference only): jitted on whole arrays, or `per_device` inside one
    `shard_map` over the stage's `data x model` mesh, where replica `d`
    trains on the `d`-th slice of each micro-batch, values cross as one
    row per device (`ROWS`) and gradients leave with one row per replica.
    A pass's own inputs are not kept as residuals: the backward pass
    takes them again."""

    def __init__(self, pipeline, per_device, num_microbatches):
        self.pipeline = pipeline
        self.stage_models = pipeline.stage_models
        self.runtimes = pipeline.stage_runtimes
        self.stats = pipeline.stats
        self.per_device = per_device
        self.replicas = pipeline.data_parallel if per_device else 1
        # `(loss share, fraction)` of a micro-batch's `(y_true, y_pred)`.
        self.loss = num_microbatches and pipeline.loss_function(
            num_microbatches
        )
        self.num_microbatches = num_microbatches
        self.last = len(self.stage_models) - 1
        self.clock = StageClock(len(self.stage_models), num_microbatches or 1)
        self._programs = {}
        # How to rebuild a forward pass's VJP from its kept residuals, by
        # stage and the signature of the pass's arguments on each device.
        self._layouts = {}

    def program(self, kind, stage):
        """A stage's compiled `"infer"`, `"forward"` or `"backward"` pass."""
        if (kind, stage) not in self._programs:
            if kind == "infer":
                function = self._forward_of(stage, training=False)
            else:
                function = getattr(self, f"_{kind}_of")(stage)
                function = self.clock.stamped(function, stage)
            self._programs[kind, stage] = counted_jit(function, self.stats)
        return self._programs[kind, stage]

    def _mapped(self, stage, local, in_specs, out_specs):
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
        return (
            jax.tree.map(lambda a: a[None], tree) if self.per_device else tree
        )

    def _from_rows(self, tree):
        return jax.tree.map(lambda a: a[0], tree) if self.per_device else tree

    def _specs(self, stage):
        # Of `(trainable, non_trainable, inputs, targets)`.
        spec = self.runtimes[stage].variable_spec
        model = self.stage_models[stage]
        return (
            [spec(v) for v in model.trainable_variables],
            [spec(v) for v in model.non_trainable_variables],
            ROWS if stage else DATA,
            DATA,
        )

    def _arguments(self, stage, trainable, non_trainable, inputs, targets):
        """`(inputs as the stage reads them, leaves of all the arguments)`."""
        inputs = self._from_rows(inputs) if stage else inputs
        leaves = (trainable, non_trainable, inputs, targets)
        return inputs, jax.tree.leaves(leaves)

    @contextlib.contextmanager
    def _traced(self, stage):
        """Marks the tracing of `stage`'s program (`calling_stage`)."""
        token = TRACING_STAGE.set(stage)
        runtime = self.runtimes[stage]
        placement = runtime.placement
        try:
            if not self.per_device:
                yield
                return
            variables = self.stage_models[stage].variables
            placed = [v for v in variables if placement.is_placed(v)]
            shapes = local_shapes(placed, placement.local_shape)
            with shapes, runtime.tracing_per_rank():
                yield
        finally:
            TRACING_STAGE.reset(token)

    def _forward_of(self, index, training=True):
        """Stage `index`'s forward pass: `(outputs, new non-trainable
        values, losses added)` for inference; for training `(outputs or
        the last stage's loss share, kept residuals, new non-trainable
        values, the last stage's predictions or the losses added)`."""
        model = self.stage_models[index]
        last = index == self.last
        adding = self.pipeline.adding_stages[index]

        def called(trainable, non_trainable, inputs, training):
            *results, losses = model.stateless_call(
                trainable,
                non_trainable,
                inputs,
                training=training,
                return_losses=True,
            )
            return *results, self.pipeline.added_total(index, losses)

        def local(trainable, non_trainable, inputs, targets=None):
            inputs, leaves = self._arguments(
                index, trainable, non_trainable, inputs, targets
            )
            if not training:
                with self._traced(index):
                    outputs, new_non_trainable, added = called(
                        trainable, non_trainable, inputs, False
                    )
                if last:
                    outputs = (outputs, carried_masks(outputs))
                else:
                    outputs = self._rows(outputs)
                return outputs, new_non_trainable, self._rows(added)
            floats, rebuild = with_floats_replaced(inputs)

            def stage(trainable, floats):
                outputs, new_non_trainable, added = called(
                    trainable, non_trainable, rebuild(floats), True
                )
                if not last:
                    floats = floats_of(outputs)
                    if not adding:
                        return floats, (new_non_trainable, outputs, None)
                    added = jax.numpy.zeros(()) if added is None else added
                    share = added / self.num_microbatches
                    return (floats, share), (new_non_trainable, outputs, added)
                # Each micro-batch's share of the batch's mean loss; the
                # predictions ride along for the metrics.
                loss, fraction = self.loss(targets, outputs)
                if added is not None:
                    loss = loss + added / self.num_microbatches
                return loss, (new_non_trainable, outputs, fraction)

            with self._traced(index):
                primal, vjp, (new_non_trainable, outputs, extra) = jax.vjp(
                    stage, trainable, floats, has_aux=True
                )
            residuals, treedef = jax.tree.flatten(vjp)
            index_of = {id(leaf): i for i, leaf in enumerate(leaves)}
            sources = tuple(index_of.get(id(leaf)) for leaf in residuals)
            self._layouts[index, signature(leaves)] = (treedef, sources)
            kept = self._rows(
                [r for r, s in zip(residuals, sources) if s is None]
            )
            if last:
                sent = self._rows((primal, extra))
                return sent, kept, new_non_trainable, outputs
            added = self._rows(extra)
            return self._rows(outputs), kept, new_non_trainable, added

        specs = self._specs(index)
        # The last stage's outputs (its predictions) and its share of the
        # loss are whole on each replica's devices.
        sent_spec = DATA if last else ROWS
        # A stage's added losses leave a program only where it adds any.
        added_spec = ROWS if adding else None
        if not training:
            out_specs = (sent_spec, specs[1], added_spec)
            return self._mapped(index, local, specs[:3], out_specs)
        out_specs = (sent_spec, ROWS, specs[1], DATA if last else added_spec)
        return self._mapped(index, local, specs, out_specs)

    def _backward_of(self, index):
        """Stage `index`'s backward pass: `(gradients, input gradients)`."""
        last = index == self.last

        def local(args, kept, cotangent, seed):
            _, leaves = self._arguments(index, *args)
            treedef, sources = self._layouts[index, signature(leaves)]
            kept = iter(self._from_rows(kept))
            vjp = jax.tree.unflatten(
                treedef,
                [next(kept) if s is None else leaves[s] for s in sources],
            )
            # The loss's gradient: 1, or a loss scale's factor.
            cotangent = seed if last else self._from_rows(cotangent)
            if self.pipeline.adding_stages[index] and not last:
                cotangent = (cotangent, seed)
            gradients, input_gradients = vjp(cotangent)
            input_gradients = self._rows(input_gradients) if index else None
            return self._rows(gradients), input_gradients

        variables = self.stage_models[index].trainable_variables
        in_specs = (self._specs(index), ROWS, ROWS, PartitionSpec())
        out_specs = (replica_rows(self.runtimes[index], variables), ROWS)
        return self._mapped(index, local, in_specs, out_specs)


class JaxStages(StagePrimitives):
    """A JAX pipeline's `programs` on one step's values: `non_trainable`
    then holds the new ones, `gradients` by stage the sums over the
    micro-batches (one row per replica)."""

    def __init__(self, programs, trainable, non_trainable, count, seed):
        super().__init__(programs.pipeline, count)
        self.programs = programs
        # What the backward passes seed the loss's gradient with.
        self.seed = seed
        self.replicas = programs.replicas
        self.trainable = trainable
        self.non_trainable = list(non_trainable)
        self.gradients = {}
        self.added = []  # one row per device
        self._residuals = {}

    def _values(self, stage, inputs):
        # The first stage's inputs are split over `data` per device.
        split = DATA if self.programs.per_device and not stage else None
        placed = onto(inputs, self.programs.runtimes[stage].mesh, split)
        return self.trainable[stage], self.non_trainable[stage], placed

    def forward(self, stage, m, inputs, target):
        args = (*self._values(stage, inputs), target)
        program = self.programs.program("forward", stage)
        outputs, kept, self.non_trainable[stage], predicted = program(*args)
        self._residuals[stage, m] = (args, kept)
        if stage == self.num_stages - 1:
            return outputs, predicted
        if predicted is not None:
            self.added.append(predicted)
        return outputs, None

    def backward(self, stage, m, cotangent):
        args, kept = self._residuals.pop((stage, m))
        program = self.programs.program("backward", stage)
        seed = onto(self.seed, self.programs.runtimes[stage].mesh)
        grads, input_grads = program(args, kept, cotangent, seed)
        if stage in self.gradients:
            grads = jax.tree.map(jax.numpy.add, self.gradients[stage], grads)
        self.gradients[stage] = grads
        return input_grads

    def send(self, value, stage, direction):
        return self.pipeline.sent(value, stage, direction)

    def placed(self, value, key):
        return onto(value, self.programs.runtimes[key].mesh)

    def infer(self, stage, inputs):
        program = self.programs.program("infer", stage)
        outputs, self.non_trainable[stage], added = program(
            *self._values(stage, inputs)
        )
        if added is not None:
            self.added.append(added)
        return outputs

    def joined(self, losses, predictions):
        # Each replica's loss is its slice's; the batch's is their mean.
        loss = self.joined_loss(losses, self.replicas) if losses else None
        rows = [split_rows(p, self.replicas, 1)[0] for p in predictions]
        return loss, join_rows(rows)


class StageClock:
    """When each stage's training passes ran on its devices: each calls
    the host once its inputs are there and once its outputs are."""

    def __init__(self, num_stages, num_microbatches):
        self.stamps = [
            collections.deque(maxlen=4 * num_microbatches)
            for _ in range(num_stages)
        ]

    def stamped(self, function, stage):
        """`function`, stamping its start and end on `stage`'s clock."""

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
            for leaf in jax.tree.leaves(tree)
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

    def times(self, order):
        """The `(start, end)` of each action of the last step's `order`."""
        jax.effects_barrier()
        spans = [iter(zip(*[iter(stamps)] * 2)) for stamps in self.stamps]
        return [next(spans[stage]) for stage, _, _ in order]
