"""The compiled programs of JAX pipeline stages with replicas.

`ReplicatedStagePrograms` runs a stage on a `data x model` mesh, whose
`data` rows are replicas of the pipeline, each on its slice of the batch.
Each pass runs per device inside one `shard_map`, as a data-parallel
step does (`keras_tp.runtime.jax.steps`): every device computes its own
gradients, summed over the micro-batches without communication, and the
replicas average them once per step, in the stage's optimizer update
(`ReplicaGradients`): the DDP minimum, or ZeRO-1's reduce-scatter and
all-gather.
"""

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from keras_tp.keras_internals import local_shapes
from keras_tp.parallel.zero import ZeroLayout
from keras_tp.runtime.jax.stages import StagePrograms
from keras_tp.runtime.jax.stages import batch_size
from keras_tp.runtime.jax.stages import counted_jit
from keras_tp.runtime.jax.stages import onto
from keras_tp.runtime.jax.stages import signature
from keras_tp.runtime.jax.stages import tracing_stage
from keras_tp.runtime.jax.storage import placement_spec
from keras_tp.tensors import is_float

# Per-device values that cross between programs, one row per device of a
# `data x model` mesh: device (d, t) of one stage sends its row to device
# (d, t) of the next.
ROWS = PartitionSpec(("data", "model"))
# The most megabytes of gradient per collective call of the replicas'
# update, as `CoordinatedOptimizer`'s default.
BUCKET_CAP_MB = 25


class ReplicatedStagePrograms(StagePrograms):
    """Each stage's passes per device, on its `data x model` mesh.

    Replica `d` (the `data` row `d` of every stage) trains on the `d`-th
    slice of each batch, in `num_microbatches` micro-batches, as a torch
    replica does. A micro-batch's arrays hold every replica's slice, split
    over `data`. Values that cross between programs (activations, their
    gradients, residuals) travel as one row per device (`ROWS`), so no
    program needs to know how each is split; the gradients leave with one
    row per replica (`"data"` on a new first axis), summed over the
    micro-batches on their devices.

    Residuals that are the pass's own inputs (the weights, the incoming
    activations) are not copied out: the backward pass takes those inputs
    again and puts them back in place.
    """

    def __init__(self, stage_models, runtimes, loss, num_microbatches, stats):
        self._layouts = {}
        self._backwards = {}
        self._tracing = None
        self.data_parallel = runtimes[0].data_parallel
        super().__init__(stage_models, runtimes, loss, num_microbatches, stats)

    def split_batch(self, tree, count):
        """Micro-batch `m` holds the `m`-th slice of each replica's part
        of the batch, replica by replica."""
        replicas = self.data_parallel
        size = batch_size(tree) // (replicas * count)

        def part(array, m):
            array = array.reshape((replicas, count, size) + array.shape[1:])
            return array[:, m].reshape((replicas * size,) + array.shape[3:])

        return [
            jax.tree_util.tree_map(lambda a, m=m: part(a, m), tree)
            for m in range(count)
        ]

    def join_batch(self, parts):
        replicas = self.data_parallel

        def whole(*leaves):
            stacked = jax.numpy.stack(leaves)
            count, rows = stacked.shape[:2]
            size = rows // replicas
            stacked = stacked.reshape(
                (count, replicas, size) + stacked.shape[2:]
            ).swapaxes(0, 1)
            return stacked.reshape((count * rows,) + stacked.shape[3:])

        return jax.tree_util.tree_map(whole, *parts)

    def place(self, stage, tree):
        if stage:
            return onto(tree, self.runtimes[stage].mesh)
        sharding = NamedSharding(
            self.runtimes[stage].mesh, PartitionSpec("data")
        )
        return jax.tree_util.tree_map(
            lambda a: jax.device_put(a, sharding), tree
        )

    def _specs(self, stage):
        """`(trainable, non_trainable, inputs, targets)` in-specs."""
        runtime = self.runtimes[stage]
        model = self.stage_models[stage]
        return (
            [runtime._variable_spec(v) for v in model.trainable_variables],
            [runtime._variable_spec(v) for v in model.non_trainable_variables],
            ROWS if stage else PartitionSpec("data"),
            PartitionSpec("data"),
        )

    def _local(self, stage):
        """A context where the stage's variables report their local shapes
        and its regions run on local values."""
        runtime = self.runtimes[stage]
        placed = [
            v
            for v in self.stage_models[stage].variables
            if runtime.placement.is_placed(v)
        ]
        return local_shapes(placed, runtime.placement.local_shape), (
            runtime._ranks()
        )

    def _inference_of(self, index):
        model = self.stage_models[index]
        last = index == self.last

        def local(trainable, non_trainable, inputs):
            if index:
                inputs = _from_rows(inputs)
            shapes, roles = self._local(index)
            with shapes, roles, tracing_stage(index):
                outputs, new_non_trainable = model.stateless_call(
                    trainable, non_trainable, inputs, training=False
                )
            return (outputs if last else _to_rows(outputs)), new_non_trainable

        specs = self._specs(index)
        return jax.shard_map(
            local,
            mesh=self.runtimes[index].mesh,
            in_specs=specs[:3],
            out_specs=(PartitionSpec("data") if last else ROWS, specs[1]),
            check_vma=False,
        )

    def _forward_of(self, index):
        model = self.stage_models[index]
        last = index == self.last
        microbatches = self.num_microbatches

        def local(trainable, non_trainable, inputs, targets):
            if index:
                inputs = _from_rows(inputs)
            candidates = jax.tree_util.tree_leaves(
                (trainable, non_trainable, inputs, targets)
            )
            floats, rebuild = _floats(inputs)

            def stage(trainable, floats):
                outputs, new_non_trainable = model.stateless_call(
                    trainable, non_trainable, rebuild(floats), training=True
                )
                if last:
                    loss = self.loss(targets, outputs) / microbatches
                    return loss, (new_non_trainable, outputs)
                return _floats(outputs)[0], (new_non_trainable, outputs)

            shapes, roles = self._local(index)
            with shapes, roles, tracing_stage(index):
                primal, vjp, (new_non_trainable, outputs) = jax.vjp(
                    stage, trainable, floats, has_aux=True
                )
            residuals, treedef = jax.tree_util.tree_flatten(vjp)
            index_of = {id(leaf): i for i, leaf in enumerate(candidates)}
            sources = tuple(index_of.get(id(leaf)) for leaf in residuals)
            self._layouts[self._tracing] = (treedef, sources)
            kept = [r for r, s in zip(residuals, sources) if s is None]
            if last:
                last_outputs = (outputs, primal[None])
                return None, _to_rows(kept), new_non_trainable, last_outputs
            return _to_rows(outputs), _to_rows(kept), new_non_trainable, None

        specs = self._specs(index)
        # The last stage's outputs (its predictions) and its share of the
        # loss are whole on each replica's devices: one row per replica.
        last_specs = (
            (PartitionSpec("data"), PartitionSpec("data")) if last else None
        )
        return jax.shard_map(
            local,
            mesh=self.runtimes[index].mesh,
            in_specs=specs,
            out_specs=(None if last else ROWS, ROWS, specs[1], last_specs),
            check_vma=False,
        )

    def forward(self, stage, trainable, non_trainable, inputs, targets):
        args = (trainable, non_trainable, inputs, targets)
        key = (stage, signature(args))
        self._tracing = key
        outputs, kept, new_non_trainable, last = self._forwards[stage](*args)
        residuals = (key, args, kept)
        if stage == self.last:
            predictions, loss = last
            return loss, residuals, new_non_trainable, predictions
        return outputs, residuals, new_non_trainable, None

    def backward(self, stage, residuals, cotangent):
        key, args, kept = residuals
        if key not in self._backwards:
            self._backwards[key] = counted_jit(
                self.clock.stamped(
                    self._backward_of(stage, *self._layouts[key]), stage
                ),
                self.stats,
            )
        return self._backwards[key](*args, kept, cotangent)

    def _backward_of(self, index, treedef, sources):
        last = index == self.last

        def local(trainable, non_trainable, inputs, targets, kept, cotangent):
            if index:
                inputs = _from_rows(inputs)
            candidates = jax.tree_util.tree_leaves(
                (trainable, non_trainable, inputs, targets)
            )
            kept = iter(_from_rows(kept))
            vjp = jax.tree_util.tree_unflatten(
                treedef,
                [next(kept) if s is None else candidates[s] for s in sources],
            )
            gradients, input_gradients = vjp(
                np.float32(1.0) if last else _from_rows(cotangent)
            )
            return (
                [g[None] for g in gradients],
                _to_rows(input_gradients) if index else None,
            )

        specs = self._specs(index)
        return jax.shard_map(
            local,
            mesh=self.runtimes[index].mesh,
            in_specs=(*specs, ROWS, ROWS),
            out_specs=(
                _replica_rows(
                    self.runtimes[index],
                    self.stage_models[index].trainable_variables,
                ),
                ROWS,
            ),
            check_vma=False,
        )

    def batch_loss(self, total):
        """Each replica's loss is its slice's; the batch's is their mean."""
        return jax.numpy.mean(total)


class ReplicaGradients:
    """How the replicas of a stage combine their gradients and updates.

    Without ZeRO each replica's gradients are averaged over `data` (DDP);
    with ZeRO-1 they are reduce-scattered, each device updates its
    partition of the weights with its partition of the optimizer state,
    and the updated partitions are all-gathered. The collectives travel
    in the `CoordinatedOptimizer`'s buckets and count as the optimizer's
    communication. Every method is traced inside the stage's jitted
    optimizer update, on whole arrays.

    Args:
        runtime: the stage's `JaxRuntime` (a `data x model` mesh).
        variables: the stage's trainable variables.
        zero_stage: 0 or 1.
        stats: the pipeline's `CommunicationStats`.
    """

    def __init__(self, runtime, variables, zero_stage, stats):
        placement = runtime.placement
        self.runtime = runtime
        self.variables = list(variables)
        self.stats = stats
        self.layout = ZeroLayout(
            placement, self.variables, zero_stage, BUCKET_CAP_MB * 2**20
        )
        self._placed = [runtime._variable_spec(v) for v in self.variables]
        self._partitioned = [
            placement_spec(
                len(placement.full_shapes[id(v)]),
                placement.split_axis(v),
                self.layout.partition_axes[id(v)],
            )
            for v in self.variables
        ]

    def _on_devices(self, local, in_specs, out_specs):
        """`local` run per device on the stage's mesh, as the optimizer's
        communication."""

        def labelled(values):
            with self.stats.labelled("optimizer"):
                return local(values)

        return jax.shard_map(
            labelled,
            mesh=self.runtime.mesh,
            in_specs=(in_specs,),
            out_specs=out_specs,
            check_vma=False,
        )

    def reduce(self, gradient_rows):
        """The gradients averaged over the replicas: whole, or each
        device's ZeRO partition of them.

        Args:
            gradient_rows: per variable, one row per replica
                (`ReplicatedStagePrograms.backward`).
        """
        adapter = self.runtime.data_adapter
        variables = self.variables

        def local(rows):
            gradients = [row[0] for row in rows]
            return self.layout.synchronised(gradients, variables, adapter)

        rows = _replica_rows(self.runtime, variables)
        return self._on_devices(local, rows, self._partitioned)(gradient_rows)

    def partitioned(self, values):
        """The weights laid out as their ZeRO partitions, so that the
        update computes each device's partition only (a local slice of
        a replicated weight, without communication)."""
        return [
            jax.lax.with_sharding_constraint(
                value, NamedSharding(self.runtime.mesh, spec)
            )
            for value, spec in zip(values, self._partitioned)
        ]

    def gathered(self, values):
        """The updated weights, whole again: each partition all-gathered."""
        adapter = self.runtime.data_adapter
        variables = self.variables

        def local(partitions):
            whole = self.layout.gathered(partitions, variables, adapter)
            return [whole.get(i, p) for i, p in enumerate(partitions)]

        return self._on_devices(local, self._partitioned, self._placed)(values)


def _replica_rows(runtime, variables):
    """Per variable, its placement with one row per replica first."""
    return [
        PartitionSpec("data", *runtime._variable_spec(v)) for v in variables
    ]


def _to_rows(tree):
    return jax.tree_util.tree_map(lambda a: a[None], tree)


def _from_rows(tree):
    return jax.tree_util.tree_map(lambda a: a[0], tree)


def _floats(tree):
    """`(float leaves, rebuild)`: a tree's differentiable leaves, and the
    function that puts new ones back among its other leaves (an integer
    padding mask passes through a stage without a gradient)."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    floats = [is_float(leaf) for leaf in leaves]

    def rebuild(new_floats):
        new = iter(new_floats)
        return jax.tree_util.tree_unflatten(
            treedef,
            [next(new) if f else leaf for leaf, f in zip(leaves, floats)],
        )

    return [leaf for leaf, f in zip(leaves, floats) if f], rebuild
