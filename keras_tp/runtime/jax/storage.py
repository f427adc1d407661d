"""How the JAX runtime stores a variable: a global array on the mesh.

A variable stays a global Keras variable whose value is placed with a
`NamedSharding`, so each device stores only its shard, and full values
are the arrays themselves (gathered across processes on several hosts).

Local SGD's replicas hold different parameters between synchronisations,
which an array replicated over `data` cannot hold: such a variable stores
one block per data rank, stacked on a leading axis split over `data`
(`store_per_replica`), and full values read replica 0's block.
"""

import json

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from keras_tp.keras_internals import direct_assign
from keras_tp.keras_internals import jax_layout
from keras_tp.keras_internals import set_jax_layout
from keras_tp.keras_internals import set_reported_shape
from keras_tp.keras_internals import set_stored_value
from keras_tp.keras_internals import stored_value
from keras_tp.runtime.base import largest_difference


def placement_spec(ndim, axis, data_axis):
    """Split `axis` over `model` and partition `data_axis` over `data`.

    On a shared axis the model shard is cut first, then partitioned.
    """
    spec = [None] * ndim
    if axis is not None:
        spec[axis] = "model"
    if data_axis is not None:
        spec[data_axis] = ("model", "data") if data_axis == axis else "data"
    return PartitionSpec(*spec)


def onto(tree, mesh, spec=None):
    """The arrays of `tree` placed on `mesh`, split by `spec` or else
    as they are split (a Column layer's output goes shard to shard), or
    whole on every device."""

    def put(array):
        sharding = getattr(array, "sharding", None)
        if spec is not None:
            split = spec
        elif isinstance(sharding, NamedSharding):
            split = sharding.spec
        else:
            split = PartitionSpec()
        return jax.device_put(array, NamedSharding(mesh, split))

    return jax.tree.map(put, tree)


def replica_rows(runtime, variables):
    """Per variable, its placement with one row per replica first."""
    return [PartitionSpec("data", *runtime.variable_spec(v)) for v in variables]


class MeshStorage:
    """The `JaxRuntime`'s variables as global arrays (see the module)."""

    def place_variable(self, variable, axis):
        self._lay_out(variable)

    def place_variable_like(self, variable, reference, data_axis):
        self._lay_out(variable, data_axis)

    def partition_variable(self, variable, data_axis):
        self._lay_out(variable, data_axis)

    def _lay_out(self, variable, data_axis=None):
        spec = placement_spec(
            len(self.placement.full_shapes[id(variable)]),
            self.placement.axes[id(variable)],
            data_axis,
        )
        # Keras' JAX variables re-apply `_layout` on every assign, and the
        # optimizer gives each slot its reference variable's layout.
        set_jax_layout(variable, NamedSharding(self.mesh, spec))
        direct_assign(variable, variable.value)

    def store_per_replica(self, variable):
        """Gives each data rank a block of its own, stacked on axis 0.

        The blocks start as copies of the current value. The variable
        reports the stacked shape, so that Keras' trainer writes back
        whole stacked values; inside per-rank steps each device sees its
        own block as the variable's local value (`_own_blocks`).
        """
        value = variable.value
        stacked = jax.numpy.broadcast_to(
            value[None], (self.data_parallel,) + tuple(value.shape)
        )
        set_jax_layout(
            variable, NamedSharding(self.mesh, self.variable_spec(variable))
        )
        set_reported_shape(variable, stacked.shape)
        direct_assign(variable, stacked)

    def first_replica_value(self, variable):
        """The value of `variable` on data rank 0 (whole, if not per
        replica)."""
        value = variable.value
        if self.placement.is_per_replica(variable):
            return value[0]
        return value

    def prepare_step_state(self, variables):
        """Replicates over the mesh every variable not laid out on it.

        A compiled step returns its outputs laid out on the mesh. An
        optimizer's step counter or a metric's total that entered on one
        device would come back replicated and enter the next step with
        another placement, and `fit()` would compile the step again (twice:
        after the first step, and when it resets the metrics).
        """
        replicated = NamedSharding(self.mesh, PartitionSpec())
        for variable in variables:
            if jax_layout(variable) is None:
                set_jax_layout(variable, replicated)
                direct_assign(variable, variable.value)

    def variable_spec(self, variable):
        """The `PartitionSpec` of `variable`'s value on the mesh."""
        if id(variable) not in self.placement.full_shapes:
            return PartitionSpec()
        spec = placement_spec(
            len(self.placement.full_shapes[id(variable)]),
            self.placement.axes[id(variable)],
            self.placement.data_axis(variable),
        )
        if self.placement.is_per_replica(variable):
            return PartitionSpec("data", *spec)
        return spec

    def full_value(self, variable):
        value = variable.value
        if not value.is_fully_addressable:
            # On several hosts every process gathers the shards it lacks.
            value = multihost_utils.process_allgather(value, tiled=True)
        value = np.asarray(value)
        if self.placement.is_per_replica(variable):
            value = value[0]
        return self.placement.canonical(variable, value)

    def assign_full_value(self, variable, value):
        """Assigns `value`; to every block of a per-replica variable."""
        value = self.placement.stored(variable, np.asarray(value))
        if self.placement.is_per_replica(variable):
            value = np.asarray(value)
            value = np.broadcast_to(
                value[None], (self.data_parallel,) + value.shape
            )
        variable.assign(value)

    def _write_unsplit(self, model, variables, write):
        """Runs `write` with full weights; on several hosts process 0 writes.

        One process reads global arrays directly, unless some variables
        hold a block per replica (local SGD), which are written as replica
        0's, or are split by blocks (stored permuted). On several hosts
        the arrays span devices this process cannot read, so every
        process gathers them, process 0 writes while its variables hold
        the full values on the host, and all processes wait for it.
        """
        stacked = any(map(self.placement.is_per_replica, variables))
        permuted = any(id(v) in self.placement.blocks for v in variables)
        if jax.process_count() == 1 and not (stacked or permuted):
            write()
            return
        full = [self.full_value(v) for v in variables]
        if jax.process_index() == 0:
            placed = [
                (jax_layout(v), stored_value(v), v.shape) for v in variables
            ]
            try:
                for variable, value in zip(variables, full):
                    set_jax_layout(variable, None)
                    set_reported_shape(variable, value.shape)
                    direct_assign(variable, jax.numpy.asarray(value))
                write()
            finally:
                for variable, (layout, value, shape) in zip(variables, placed):
                    set_jax_layout(variable, layout)
                    set_reported_shape(variable, shape)
                    set_stored_value(variable, value)
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("keras_tp: model written")

    def device_bytes(self, variables):
        totals = {str(d): 0 for d in self.mesh.devices.flat}
        for variable in variables:
            for shard in variable.value.addressable_shards:
                if str(shard.device) in totals:
                    totals[str(shard.device)] += shard.data.nbytes
        return totals

    def replica_differences(self, variables):
        """Largest difference between the copies of each variable.

        Devices holding the same slice of a global array (the data-parallel
        replicas, and the model ranks of a replicated variable) must hold
        the same numbers. Across processes every process's shards are
        gathered (`process_allgather`), so that each compares them all.
        """
        differences = {}
        for variable in variables:
            shards = list(self._shards(variable))
            keys = np.array(
                [[(s.start, s.stop) for s in index] for _, index, _ in shards],
                dtype=float,
            )
            data = np.stack([data for _, _, data in shards])
            if jax.process_count() > 1:
                keys, data = _of_every_process(keys), _of_every_process(data)
            copies = {}
            for key, copy in zip(keys, data):
                copies.setdefault(key.tobytes(), []).append(copy)
            differences[variable.path] = largest_difference(copies)
        return differences

    def _shards(self, variable):
        """`(shard, index, values)` of each shard of `variable` held here.

        A per-replica variable's shard is part of one data rank's block:
        its index and values lose the leading (replica) axis, so that the
        index places the piece in that replica's value.
        """
        stacked = self.placement.is_per_replica(variable)
        for shard in variable.value.addressable_shards:
            index, data = shard.index, np.asarray(shard.data)
            if stacked:
                index, data = index[1:], data[0]
            yield shard, index, data

    def local_pieces(self, variable):
        """The first copy of each of the variable's shards held here
        (replica 0's block of a per-replica variable)."""
        shape = self.full_shape(variable)
        stacked = self.placement.is_per_replica(variable)
        return [
            (str(shard.device).replace(":", ""), run, data[local])
            for shard, index, data in self._shards(variable)
            if shard.replica_id == 0 and not (stacked and shard.index[0].start)
            for local, run in self._runs(variable, _index(index, shape))
        ]

    def _runs(self, variable, index):
        if self.placement.is_placed(variable):
            return self.placement.index_runs(variable, index)
        return [(tuple(slice(None) for _ in index), index)]

    def _read_stored(self, variable, index, read):
        """The stored piece at `index`, from `read` of canonical pieces."""
        runs = self._runs(variable, index)
        if len(runs) == 1:
            return read(runs[0][1])
        axis = self.placement.axes[id(variable)]
        return np.concatenate([read(run) for _, run in runs], axis)

    def assign_local_pieces(self, variable, read):
        value = variable.value
        if jax_layout(variable) is None:
            # Not laid out on the mesh (an iteration count): JAX places
            # such a value where each computation needs it.
            variable.assign(read(_index((), value.shape)))
            return
        if not self.placement.is_per_replica(variable):
            placed = jax.make_array_from_callback(
                value.shape,
                value.sharding,
                lambda index: self._read_stored(
                    variable, _index(index, value.shape), read
                ),
            )
            direct_assign(variable, placed)
            return
        # Every replica's block takes the piece.
        shape = value.shape[1:]

        def blocks(index):
            piece = self._read_stored(variable, _index(index[1:], shape), read)
            rows = len(range(*index[0].indices(self.data_parallel)))
            return np.broadcast_to(piece[None], (rows,) + piece.shape)

        direct_assign(
            variable,
            jax.make_array_from_callback(value.shape, value.sharding, blocks),
        )

    def process_index(self):
        return jax.process_index()

    def wait_for_processes(self):
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("keras_tp: checkpoint")

    def gather_objects(self, value):
        """Every process's `value` (JSON-like), as JSON bytes gathered over
        `jax.distributed`; `None` in one process."""
        if jax.process_count() == 1:
            return None
        encoded = np.frombuffer(json.dumps(value).encode(), np.uint8)
        sizes = multihost_utils.process_allgather(np.int64(encoded.size))
        padded = np.zeros(int(np.max(sizes)), np.uint8)
        padded[: encoded.size] = encoded
        everyone = multihost_utils.process_allgather(padded)
        return [
            json.loads(row[:size].tobytes())
            for row, size in zip(everyone, np.ravel(sizes))
        ]

    def equalize_values(self, variables):
        if jax.process_count() == 1:
            return
        values = multihost_utils.broadcast_one_to_all(
            [np.asarray(variable.value) for variable in variables]
        )
        for variable, value in zip(variables, values):
            variable.assign(value)


def _index(slices, shape):
    """A shard's `index` (slices, open-ended or missing) as `(start, stop)`s."""
    slices = tuple(slices) + (slice(None),) * (len(shape) - len(slices))
    return tuple(
        (s.start or 0, size if s.stop is None else s.stop)
        for s, size in zip(slices, shape)
    )


def _of_every_process(array):
    """`array` of every process (all of one shape), concatenated along
    its first axis in process order."""
    gathered = np.asarray(multihost_utils.process_allgather(array))
    return gathered.reshape(jax.process_count() * len(array), *array.shape[1:])
