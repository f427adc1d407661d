"""Storage of the TensorFlow runtime: a per-replica variable per Keras one.

Each Keras variable of the model keeps its full (logical) shape, but its
storage becomes a per-replica variable (`synchronization=ON_READ`): one
component on each device, holding that rank's shard, or a whole copy for a
replicated variable. Replica code reads and updates its own component
without any synchronisation. Reading a split variable outside replica
context raises; `get_weights()`, `set_weights()` and `save()` go through
the runtime, which assembles or splits the value. Optimizer slots, gradient
accumulation buffers and (ZeRO-3) parameters hold one data partition of
their shard per replica.
"""

import contextlib
import logging
import threading

import keras
import numpy as np
import tensorflow as tf

from keras_tp.keras_internals import local_shapes
from keras_tp.keras_internals import set_stored_value
from keras_tp.keras_internals import stored_value
from keras_tp.runtime.tensorflow import coordination
from keras_tp.runtime.tensorflow.devices import HOST
from keras_tp.runtime.tensorflow.devices import device_name
from keras_tp.tensors import nbytes

logger = logging.getLogger(__name__)


class ReplicaStorage:
    """Runtime mixin: places, reads, writes and saves per-replica variables."""

    def place_variable(self, variable, axis):
        self._store(variable, axis)

    def place_variable_like(self, variable, reference, data_axis):
        self._store(variable, self.placement.axes[id(variable)], data_axis)

    def partition_variable(self, variable, data_axis):
        self._store(
            variable,
            self.placement.axes[id(variable)],
            data_axis,
            full=self._stored_full_value(variable),
        )

    def _store(self, variable, axis, data_axis=None, full=None):
        """Gives `variable` a per-replica storage of its pieces.

        Args:
            variable: the Keras variable; its current value is the full one
                unless `full` is given.
            axis: the axis split over `model`, or `None`.
            data_axis: the axis of the shard partitioned over `data`, or
                `None`.
            full: the full value, for a variable already placed.
        """
        # TensorFlow's optimizers key a variable by its storage (as
        # `exclude_from_weight_decay(var_list=...)` did before placement).
        key = getattr(stored_value(variable), "_unique_id", None)
        if key is not None:
            self.former_keys.setdefault(key, variable)
        with tf.init_scope():
            if full is None:
                full = keras.ops.convert_to_numpy(variable.value)
            set_stored_value(
                variable,
                self._per_replica_variable(variable, full, axis, data_axis),
            )

    def storage_copy(self, variable, axis):
        """A per-replica storage on this runtime's replicas holding the
        pieces of `variable`'s current (full) value, split on `axis`; for
        a pipeline stage that reads another stage's weight."""
        with tf.init_scope():
            full = keras.ops.convert_to_numpy(variable.value)
            return self._per_replica_variable(variable, full, axis, None)

    def _per_replica_variable(self, variable, full, axis, data_axis):
        """A per-replica tf.Variable whose components hold their pieces."""
        shards = self._local_shards(full, axis, data_axis)
        with self.strategy.scope():
            storage = tf.Variable(
                shards[0],
                dtype=variable.dtype,
                trainable=variable.trainable,
                name=variable.name,
                synchronization=tf.VariableSynchronization.ON_READ,
                # Reading a split variable outside a replica must fail, not
                # quietly return shard 0; a replicated one reads replica 0.
                aggregation=(
                    tf.VariableAggregation.NONE
                    if axis is not None or data_axis is not None
                    else tf.VariableAggregation.ONLY_FIRST_REPLICA
                ),
            )
        for component, shard in zip(storage.values, shards):
            component.assign(shard)
        return storage

    def _local_shards(self, full, axis, data_axis=None):
        """The piece of `full` each local replica holds, in replica order:
        its model rank's shard, and its data rank's partition of it."""
        model, data = self.tensor_parallel, self.data_parallel
        pieces = []
        for replica in self._local_replicas:
            data_rank, model_rank = divmod(replica, model)
            piece = full
            if axis is not None:
                piece = np.split(piece, model, axis)[model_rank]
            if data_axis is not None:
                piece = np.split(piece, data, data_axis)[data_rank]
            pieces.append(piece)
        return pieces

    @staticmethod
    def _components(variable):
        storage = variable.value
        if isinstance(storage, tf.distribute.DistributedValues):
            return storage.values
        return (storage,)

    def full_value(self, variable):
        stored = self._stored_full_value(variable)
        return self.placement.canonical(variable, stored)

    def _stored_full_value(self, variable):
        """The full value in the layout the replicas store it in."""
        components = self._components(variable)
        axis = self.placement.split_axis(variable)
        data_axis = self.placement.data_axis(variable)
        if axis is None and data_axis is None:
            return components[0].numpy()
        if len(self._local_replicas) < self.world_size:
            # Several workers: the other pieces live on other hosts.
            pieces = self._pieces_across_hosts(variable)
        else:
            pieces = [component.numpy() for component in components]
        model = self.tensor_parallel
        shards = []
        for model_rank in range(model if axis is not None else 1):
            partitions = [
                pieces[data_rank * model + model_rank]
                for data_rank in range(
                    self.data_parallel if data_axis is not None else 1
                )
            ]
            shards.append(
                partitions[0]
                if data_axis is None
                else np.concatenate(partitions, axis=data_axis)
            )
        return shards[0] if axis is None else np.concatenate(shards, axis=axis)

    def _pieces_across_hosts(self, variable):
        """Every replica's piece of `variable`, in replica order: one
        all-gather over every replica, of the strategy's own."""

        def gather():
            context = tf.distribute.get_replica_context()
            return context.all_gather(local_read(variable)[None], 0)

        gathered = tf.function(lambda: self.strategy.run(gather))()
        pieces = self.strategy.experimental_local_results(gathered)[0]
        return list(pieces.numpy())

    def assign_full_value(self, variable, value):
        value = self.placement.stored(variable, np.asarray(value))
        pieces = self._local_shards(
            value,
            self.placement.split_axis(variable),
            self.placement.data_axis(variable),
        )
        for component, piece in zip(self._components(variable), pieces):
            component.assign(piece)

    def _write_unsplit(self, model, variables, write):
        """Writes with every variable assembled on the host; on several
        workers only the chief writes."""
        with self.assembled(variables):
            if self._is_chief():
                write()
            else:
                logger.info("Worker is not the chief: nothing written.")

    @contextlib.contextmanager
    def assembled(self, variables):
        """Gives each placed variable a plain, full storage on the host."""
        storages = {}
        try:
            for variable in variables:
                if not self.placement.is_placed(variable):
                    continue
                full = self.full_value(variable)
                storages[id(variable)] = (variable, stored_value(variable))
                with tf.device(HOST):
                    set_stored_value(
                        variable,
                        tf.Variable(
                            full,
                            trainable=variable.trainable,
                            name=variable.name,
                        ),
                    )
            yield
        finally:
            for variable, storage in storages.values():
                set_stored_value(variable, storage)

    def _ranks_here(self):
        ranks = []
        for replica in self._local_replicas:
            data_rank, model_rank = divmod(replica, self.tensor_parallel)
            ranks.append((f"replica{replica}", model_rank, data_rank))
        return ranks

    def _read_piece(self, variable, position):
        return self._components(variable)[position].numpy()

    def _write_piece(self, variable, position, value):
        self._components(variable)[position].assign(value)

    def is_first_process(self):
        return self._is_chief()

    def process_index(self):
        return self._local_replicas[0] // len(self._local_replicas)

    def gather_objects(self, value):
        """Every worker's `value`, through TensorFlow's coordination
        service (`coordination.gathered`); `None` in one process."""
        processes = self.world_size // len(self._local_replicas)
        if processes == 1:
            return None
        return coordination.gathered(value, self.process_index(), processes)

    def wait_for_processes(self):
        """A one-number all-reduce over every replica: on several workers
        it returns once every worker has called it."""
        if len(self._local_replicas) == self.world_size:
            return

        def one():
            context = tf.distribute.get_replica_context()
            return context.all_reduce("sum", tf.ones(()))

        tf.function(lambda: self.strategy.run(one))()

    def equalize_values(self, variables):
        """One all-reduce of every value, as float64 (exact for the
        integers of seed states), where only the first process's first
        replica adds its own: on several workers every worker then holds
        the first's values."""
        if len(self._local_replicas) == self.world_size or not variables:
            return
        own = tf.concat(
            [tf.reshape(tf.cast(v.value, tf.float64), [-1]) for v in variables],
            0,
        )
        if not self.is_first_process():
            own = tf.zeros_like(own)

        def first_only():
            context = tf.distribute.get_replica_context()
            first = tf.equal(context.replica_id_in_sync_group, 0)
            return context.all_reduce(
                "sum", tf.where(first, own, tf.zeros_like(own))
            )

        reduced = self.strategy.run(tf.function(first_only))
        total = self.strategy.experimental_local_results(reduced)[0]
        sizes = [int(np.prod(v.shape)) for v in variables]
        for variable, part in zip(variables, tf.split(total, sizes)):
            variable.assign(
                tf.cast(tf.reshape(part, variable.shape), variable.dtype)
            )

    def device_bytes(self, variables):
        totals = {device: 0 for device in self.devices}
        for variable in variables:
            for component in self._components(variable):
                name = device_name(component.device)
                totals[name] = totals.get(name, 0) + nbytes(component)
        return totals

    def replica_differences(self, variables):
        """Largest difference between the copies of each variable.

        Replicas holding the same piece (the data-parallel rows for a shard
        or a partition, and the model ranks of a replicated variable) must
        hold the same numbers. Each replica gathers those replicas' copies
        of its piece, on every worker, and the largest difference is
        all-reduced over all of them.
        """

        def differences():
            worst = []
            for variable in variables:
                local = tf.cast(local_read(variable), tf.float32)
                difference = tf.zeros((), tf.float32)
                peers = []
                if self.placement.data_axis(variable) is None:
                    peers.append(self.data_adapter)
                if self.placement.split_axis(variable) is None:
                    peers.append(self.adapter)
                for adapter in peers:
                    copies = adapter.all_gather(local[None], axis=0)
                    difference = tf.maximum(
                        difference, tf.reduce_max(tf.abs(copies - local))
                    )
                worst.append(difference)
            return self.world_adapter.all_reduce(tf.stack(worst), "max")

        if not variables:
            return {}
        worst = self._on_replicas(differences).numpy()
        return {
            variable.path: float(difference)
            for variable, difference in zip(variables, worst)
        }


class ReplicaShapes:
    """Makes the placed variables report the shapes replicas hold.

    Keras checks every `assign` against the variable's shape; inside a
    replica the values are shards and partitions.

    Args:
        placement: the runtime's `Placement`.
    """

    def __init__(self, placement):
        self._placement = placement
        self._lock = threading.Lock()
        self._users = 0
        self._context = None

    @contextlib.contextmanager
    def __call__(self, model):
        """Local shapes for the variables of `model` and of its optimizer.

        Args:
            model: the `TensorParallelKeras` model.
        """
        variables = list(model.variables)
        # `optimizer` exists once the model is compiled.
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            variables += optimizer.variables
        placed = [v for v in variables if self._placement.is_placed(v)]
        # Replicas run in threads and may each enter: the first one in
        # sets the shapes, the last one out restores them.
        with self._lock:
            if not self._users:
                self._context = contextlib.ExitStack()
                self._context.enter_context(
                    local_shapes(placed, self._placement.local_shape)
                )
            self._users += 1
        try:
            yield
        finally:
            with self._lock:
                self._users -= 1
                if not self._users:
                    self._context.close()


def local_read(variable):
    """This replica's value of a Keras variable, as a tensor.

    `tf.identity` rather than `tf.convert_to_tensor`: a multi-worker
    collective given the latter's result takes it for the distributed
    variable itself and fails.
    """
    return tf.identity(variable.value)
