"""JAX adapter: `jax.lax` collectives over a named axis of a `shard_map`."""

import functools

import jax
from jax._src.lax.parallel import all_gather_invariant
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from keras_tp.collectives.base import CollectiveAdapter

# The reduction of each `op`, for groups reduced on each device.
_REDUCTIONS = {
    "sum": jax.numpy.sum,
    "mean": jax.numpy.mean,
    "max": jax.numpy.max,
    "min": jax.numpy.min,
}


class JaxCollectiveAdapter(CollectiveAdapter):
    """Collectives over the `axis_name` axis of a `jax.sharding.Mesh`.

    Valid inside `jax.shard_map`. The conjugate operators are
    `jax.custom_vjp`s so that the backward collectives are explicit (and
    counted) and a gradient is never reduced twice. With `check_vma=True`
    (a region's own `shard_map`) JAX tracks which values vary across
    devices; a whole per-rank step runs with `check_vma=False`, where every
    differentiated collective must carry its own gradient rule, so
    `reduce_from_parallel` becomes a `custom_vjp` too.

    With `axis_index_groups` the collectives run within groups of the
    axis' devices (the levels of a `HierarchicalAdapter`): raw collectives
    only, since they carry no gradients.

    Args:
        axis_size: number of devices along `axis_name` (a name or a tuple
            of names, for collectives over several axes), or in each group.
        axis_name: mesh axis the collectives run over.
        check_vma: whether the enclosing `shard_map` checks varying
            manual axes.
        axis_index_groups: lists of indices along `axis_name`, each a
            group of `axis_size` devices; `None` for the whole axis.
    """

    backend = "jax"

    def __init__(
        self,
        axis_size,
        axis_name="model",
        check_vma=True,
        axis_index_groups=None,
    ):
        super().__init__(axis_name)
        self._axis_size = axis_size
        self.check_vma = check_vma
        self._groups = axis_index_groups
        # Each device's place in its group, by its index along the axis.
        self._places = (
            None
            if axis_index_groups is None
            else [
                place
                for _, place in sorted(
                    (index, place)
                    for group in axis_index_groups
                    for place, index in enumerate(group)
                )
            ]
        )
        if axis_index_groups is None:
            self._build_conjugate_ops()
            self._build_partition_gather()

    def rank(self):
        index = jax.lax.axis_index(self.axis_name)
        if self._groups is None:
            return index
        return jax.numpy.array(self._places)[index]

    def size(self):
        return self._axis_size

    def _all_reduce(self, x, op):
        axis = self.axis_name
        if self._groups is not None:
            # shard_map has no psum over groups of an axis: gather the
            # group's values and reduce them here.
            values = self._all_gather(x[None], 0)
            return _REDUCTIONS[op](values, axis=0)
        if op == "sum":
            return jax.lax.psum(x, axis)
        if op == "mean":
            return jax.lax.pmean(x, axis)
        if op == "max":
            return jax.lax.pmax(x, axis)
        return jax.lax.pmin(x, axis)

    def _all_gather(self, x, axis):
        if self._groups is not None:
            return jax.lax.all_gather(
                x,
                self.axis_name,
                axis=axis,
                tiled=True,
                axis_index_groups=self._groups,
            )
        if self.check_vma:
            return jax.lax.all_gather(x, self.axis_name, axis=axis, tiled=True)
        # Every rank receives the same result; without vma tracking the
        # invariant form keeps a later gradient from being reduced again.
        return all_gather_invariant(x, self.axis_name, axis=axis, tiled=True)

    def _reduce_scatter(self, x, axis, op):
        out = jax.lax.psum_scatter(
            x,
            self.axis_name,
            scatter_dimension=axis,
            tiled=True,
            axis_index_groups=self._groups,
        )
        return out / self._axis_size if op == "mean" else out

    def _broadcast(self, x, root):
        if self._groups is not None:
            return self._all_gather(x[None], 0)[root]
        # Zero every rank's value but the root's: the sum is the root's value.
        keep = (jax.lax.axis_index(self.axis_name) == root).astype(x.dtype)
        return jax.lax.psum(x * keep, self.axis_name)

    def barrier(self):
        """No-op: a compiled SPMD program has no rank that runs ahead."""

    def _build_conjugate_ops(self):
        mesh_axis = self.axis_name
        record = self._record
        check_vma = self.check_vma

        def varying(x):
            return jax.lax.pcast(x, mesh_axis, to="varying") if check_vma else x

        @jax.custom_vjp
        def copy_to_parallel(x):
            return varying(x)

        def copy_fwd(x):
            return copy_to_parallel(x), None

        def copy_bwd(_, grad):
            record("all_reduce", grad, "backward")
            return (jax.lax.psum(grad, mesh_axis),)

        copy_to_parallel.defvjp(copy_fwd, copy_bwd)

        def reduce_from_parallel(x):
            # psum of a device-varying value is device-invariant; under
            # check_vma its transpose is a plain broadcast, with no collective.
            record("all_reduce", x, "forward")
            return jax.lax.psum(x, mesh_axis)

        @jax.custom_vjp
        def reduce_untracked(x):
            record("all_reduce", x, "forward")
            return jax.lax.psum(x, mesh_axis)

        def reduce_untracked_fwd(x):
            return reduce_untracked(x), None

        def reduce_untracked_bwd(_, grad):
            # Without vma tracking psum would transpose to another psum.
            return (grad,)

        reduce_untracked.defvjp(reduce_untracked_fwd, reduce_untracked_bwd)

        def gather_from_parallel(x, axis=-1):
            record("all_gather", x, "forward", self._axis_size)
            # The invariant all-gather transposes to a local slice: the
            # cotangent of a replicated output is already equal on all ranks.
            return all_gather_invariant(
                x, mesh_axis, axis=axis % x.ndim, tiled=True
            )

        def gathering_gradient(forward, gradient=lambda whole: whole):
            """`forward(x, axis)` whose gradient is all-gathered on `axis`
            (then passed through `gradient`)."""

            @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
            def op(x, op_axis):
                return forward(x, op_axis)

            def op_fwd(x, op_axis):
                return op(x, op_axis), None

            def op_bwd(op_axis, _, grad):
                record("all_gather", grad, "backward", self._axis_size)
                whole = all_gather_invariant(
                    grad, mesh_axis, axis=op_axis, tiled=True
                )
                return (gradient(whole),)

            op.defvjp(op_fwd, op_bwd)
            return op

        def local_slice(x, scatter_axis):
            local = x.shape[scatter_axis] // self._axis_size
            start = jax.lax.axis_index(mesh_axis) * local
            x = varying(x)
            return jax.lax.dynamic_slice_in_dim(x, start, local, scatter_axis)

        scatter = gathering_gradient(local_slice)

        def scatter_to_parallel(x, axis=-1):
            return scatter(x, axis % x.ndim)

        # Each rank's gradient of the whole sequence is its partial sum:
        # the backward pass reduce-scatters it.
        gather_sequence = _gather_scattering_gradient(mesh_axis, record)

        reduce_scatter_sequence = gathering_gradient(
            lambda x, sequence_axis: jax.lax.psum_scatter(
                x, mesh_axis, scatter_dimension=sequence_axis, tiled=True
            ),
            varying,
        )

        def gather_sequence_counted(x, axis=1):
            record("all_gather", x, "forward", self._axis_size)
            return gather_sequence(x, axis % x.ndim)

        def reduce_scatter_sequence_counted(x, axis=1):
            record("reduce_scatter", x, "forward")
            return reduce_scatter_sequence(x, axis % x.ndim)

        self.gather_sequence = gather_sequence_counted
        self.reduce_scatter_sequence = reduce_scatter_sequence_counted
        self.copy_to_parallel = copy_to_parallel
        self.reduce_from_parallel = (
            reduce_from_parallel if check_vma else reduce_untracked
        )
        self.gather_from_parallel = gather_from_parallel
        self.scatter_to_parallel = scatter_to_parallel

    def _build_partition_gather(self):
        # Each rank receives the mean gradient of its own partition.
        self._gather_partitions = _gather_scattering_gradient(
            self.axis_name, self._record, self._axis_size
        )

    def sequence_copies_per_device(self, mesh, sequence_axis=1):
        """Sequence parallelism's entry on global arrays.

        Like `copies_per_device`, one copy of `x` per rank of `mesh`, each
        the whole of `x` all-gathered from the ranks' sequence shards
        (`gather_sequence`); the copies' gradients, summed, are
        reduce-scattered back to the shards. Every region that reads `x`
        shares one all-gather.

        Returns:
            A function of `x`, split on `sequence_axis` over this adapter's
            axis, with a leading axis of `size()` copies.
        """
        shards = PartitionSpec(*([None] * sequence_axis), self.axis_name)
        return jax.shard_map(
            lambda x: self.gather_sequence(x, sequence_axis)[None],
            mesh=mesh,
            in_specs=shards,
            out_specs=PartitionSpec(self.axis_name),
            check_vma=True,
        )

    def copies_per_device(self, mesh):
        """Megatron `f` on global arrays: one copy of `x` per rank of `mesh`.

        For a region called on global arrays (outside a `shard_map`): the
        copies are laid out one per device along this adapter's axis (no
        communication), and their gradient, each device's partial sum, is
        summed over the devices: one all-reduce, however many regions read
        them.

        Returns:
            A function of `x` with a leading axis of `size()` copies.
        """
        size = self._axis_size
        layout = NamedSharding(mesh, PartitionSpec(self.axis_name))
        record = self._record

        @jax.custom_vjp
        def copies(x):
            stacked = jax.numpy.broadcast_to(x[None], (size,) + x.shape)
            return jax.lax.with_sharding_constraint(stacked, layout)

        def copies_fwd(x):
            return copies(x), None

        def copies_bwd(_, grad):
            record("all_reduce", grad[0], "backward")
            return (jax.numpy.sum(grad, axis=0),)

        copies.defvjp(copies_fwd, copies_bwd)
        return copies


def _gather_scattering_gradient(axis_name, record, divisor=1):
    """An all-gather over `axis_name` whose gradient is reduce-scattered.

    Args:
        axis_name: the mesh axis.
        record: the adapter's `_record`, which counts the backward call.
        divisor: what the reduced gradient is divided by (the axis size
            for a mean).

    Returns:
        A function of `(x, axis)`, `axis` the one gathered along.
    """

    @functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
    def gather(x, axis):
        return jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)

    def gather_fwd(x, axis):
        return gather(x, axis), None

    def gather_bwd(axis, _, grad):
        record("reduce_scatter", grad, "backward")
        summed = jax.lax.psum_scatter(
            grad, axis_name, scatter_dimension=axis, tiled=True
        )
        return (summed / divisor,)

    gather.defvjp(gather_fwd, gather_bwd)
    return gather


def counted_jit(function, stats):
    """`jax.jit(function)` whose collectives, recorded while it is traced
    (once per input signature), count again at every call."""
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
        for leaf in jax.tree.leaves(tree)
    )
