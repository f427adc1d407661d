"""TensorFlow runtime: the ranks are the replicas of a `tf.distribute` strategy.

On one host the strategy is a `tf.distribute.MirroredStrategy` over the
chosen devices (GPUs, or the virtual CPUs made by
`configure_virtual_devices`); across hosts it is the
`MultiWorkerMirroredStrategy` that `configure_multi_worker()` builds from
`TF_CONFIG`. DTensor is not used.

How the pieces fit:

- **Variables.** Each Keras variable of the model keeps its full (logical)
  shape, but its storage becomes a per-replica variable
  (`synchronization=ON_READ`): one component on each device, holding that
  rank's shard, or a whole copy for a replicated variable. Replica code reads
  and updates its own component without any synchronisation. Reading a split
  variable outside replica context raises; `get_weights()`, `set_weights()`
  and `save()` go through the runtime, which assembles or splits the value.
- **Steps.** Keras' TensorFlow trainer would run its step in every replica
  and treat the replicas as data parallel: it splits each batch, divides the
  loss by the number of replicas and sums the gradients over them. For
  tensor parallelism the model is therefore not put under the strategy;
  Keras sees one device and `run_step` runs the replicas itself: every
  replica computes the forward pass on the same full batch, the loss and the
  metrics are computed once from the (replicated) output, and the gradient
  of the loss with respect to that output is sent back to every replica,
  which finishes the backward pass and updates its own shards with the
  wrapped optimizer (`TensorParallelOptimizer`). The loss is never scaled
  and no gradient goes through the optimizer's all-reduce; the gradients of
  replicated variables are broadcast from replica 0 (one collective per
  step) so that their copies stay bit-identical.
- **Sharded regions.** Inside a replica a sharded layer runs on the local
  weights with the collectives of `TensorFlowCollectiveAdapter`. Called
  outside a step (a direct `model(x)`), each sharded layer runs as its own
  small replica step and its split outputs are gathered (these gathers are
  counted in the `"call"` phase); this path gives exact outputs but no
  gradients.
- **Data axis and ZeRO.** The replicas form the `data x model` mesh, replica
  `d * T + m` being model rank `m` of data-parallel row `d`. The model axis
  runs over the replicas of a row and the data axis over those of a column,
  each with collective groups of its own (`ReplicaGroups`). Every row runs
  the forward pass on its slice of the global batch; the loss and metrics
  are computed once, on the rows' outputs put back together, so they are
  those of the global batch; each row receives `D` times the gradient of
  the global loss with respect to its output (the gradient of its own mean
  loss), and the `CoordinatedOptimizer` averages the parameter gradients
  over the data axis, reduce-scatters them or gathers partitions according
  to the ZeRO stage. Optimizer slots, gradient buffers and (ZeRO-3)
  parameters hold one data partition of their shard per replica. Steps with
  a data axis are always traced, since such groups cannot run eagerly.
"""

import concurrent.futures
import contextlib
import json
import logging
import os
import threading
import warnings

import keras
import numpy as np
import tensorflow as tf
from keras.src.backend.common.stateless_scope import get_stateless_scope
from keras.src.optimizers import base_optimizer

from keras_tp.collectives.base import nbytes
from keras_tp.collectives.tensorflow import ReplicaGroups
from keras_tp.collectives.tensorflow import TensorFlowCollectiveAdapter
from keras_tp.parallel import CoordinatedOptimizer
from keras_tp.regions import shared_value
from keras_tp.runtime.base import Runtime
from keras_tp.runtime.base import largest_difference
from keras_tp.keras_internals import bind_values
from keras_tp.keras_internals import local_shapes

logger = logging.getLogger(__name__)

_HOST = "/device:CPU:0"
_MULTI_WORKER_STRATEGY = None
# Group keys of the mesh axes start this far above the strategy's own.
_GROUP_KEY_OFFSET = 50000


def configure_virtual_devices(n):
    """Splits the CPU into `n` logical devices; must run before TF starts.

    Args:
        n: number of CPU devices to create.

    Raises:
        RuntimeError: if TensorFlow already runs with another number of CPU
            devices.
    """
    cpu = tf.config.list_physical_devices("CPU")[0]
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration() for _ in range(n)]
        )
    except RuntimeError:
        have = len(tf.config.list_logical_devices("CPU"))
        if have == n:
            return
        raise RuntimeError(
            f"TensorFlow is already initialised with {have} CPU device(s), "
            f"so configure_virtual_devices({n}) cannot take effect. Call it "
            "right after `import keras_tp`, before any Keras or TensorFlow "
            "operation (in a notebook: restart the kernel)."
        ) from None
    if tf.config.list_physical_devices("GPU"):
        logger.info(
            "GPUs found: keras_tp will use them; the %d virtual CPU devices "
            "are only used if you pass their device_ids.",
            n,
        )


def configure_multi_worker():
    """Creates the `MultiWorkerMirroredStrategy` described by `TF_CONFIG`.

    TensorFlow only configures cross-process collectives before its first
    operation, so a multi-worker program calls this first thing, on every
    worker; `TensorParallelKeras` then uses one replica per worker device.

    Returns:
        The `tf.distribute.MultiWorkerMirroredStrategy`.

    Example:

    ```python
    # Run on each worker, with TF_CONFIG naming the cluster and this task.
    import keras_tp
    from keras_tp.runtime.tensorflow import configure_multi_worker
    configure_multi_worker()
    model = build_my_keras_model()
    tp = keras_tp.TensorParallelKeras(model)   # world_size = all replicas
    ```
    """
    global _MULTI_WORKER_STRATEGY
    if _MULTI_WORKER_STRATEGY is None:
        _MULTI_WORKER_STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()
    return _MULTI_WORKER_STRATEGY


def _tf_config_workers():
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    return len(config.get("cluster", {}).get("worker", []))


def _device_name(device):
    """`cpu:1` for a local device; job and task kept for a worker's."""
    spec = tf.DeviceSpec.from_string(device)
    name = f"{spec.device_type.lower()}:{spec.device_index or 0}"
    if spec.job in (None, "localhost"):
        return name
    return f"/job:{spec.job}/task:{spec.task}/device:{name}"


def _full_device_name(device):
    """`/device:CPU:1` for `cpu:1`: the name TensorFlow orders ranks by."""
    return tf.DeviceSpec.from_string(device).to_string()


class _MirroredStrategy(tf.distribute.MirroredStrategy):
    """A `MirroredStrategy` whose collectives never collide with another's.

    Every `MirroredStrategy` numbers its collective groups from 1, so two of
    them in one process (two models, or 2 and 4 devices) would share group
    and instance keys and their collectives would mix. Each one here starts
    at its own base, as TensorFlow's own tests do.
    """

    _KEY_STRIDE = 100000
    _instances = 0

    def __init__(self, devices):
        _MirroredStrategy._instances += 1
        # Read by MirroredExtended when the strategy is built.
        self._collective_key_base = (
            _MirroredStrategy._instances * self._KEY_STRIDE
        )
        super().__init__(devices)


class TensorFlowRuntime(Runtime):
    """Runs tensor parallelism, DDP and ZeRO on `tf.distribute` replicas.

    The replica with id `d * T + m` is model rank `m` of data-parallel row
    `d` (`T` is the tensor-parallel size): it owns shard `m` of every split
    variable and, under ZeRO, partition `d` of that shard.
    """

    backend = "tensorflow"
    # The replicas run under tf.distribute, which XLA cannot compile as one
    # program (see `run_step`).
    jit_compile_default = False

    def _available_devices(self):
        if _MULTI_WORKER_STRATEGY is not None:
            return self._multi_worker_devices(_MULTI_WORKER_STRATEGY)
        if _tf_config_workers() > 1:
            raise RuntimeError(
                "TF_CONFIG describes several workers: call "
                "`keras_tp.runtime.tensorflow.configure_multi_worker()` at "
                "the start of the program, before any TensorFlow operation."
            )
        gpus = tf.config.list_logical_devices("GPU")
        devices = gpus or tf.config.list_logical_devices("CPU")
        return [_device_name(device.name) for device in devices]

    @staticmethod
    def _multi_worker_devices(strategy):
        workers = strategy.cluster_resolver.cluster_spec().num_tasks("worker")
        local = [_device_name(d) for d in strategy.extended.worker_devices]
        task = strategy.cluster_resolver.task_id
        return [
            name.replace(f"/task:{task}/", f"/task:{other}/")
            for other in range(workers)
            for name in local
        ]

    def _build(self):
        # Whether a layer reads split variables outside regions.
        self._local_layers = False
        self._shapes_lock = threading.Lock()
        self._shapes_users = 0
        self._shapes_context = None
        if _MULTI_WORKER_STRATEGY is not None:
            if self.per_rank_steps:
                raise NotImplementedError(
                    f"data_parallel={self.data_parallel}, zero_stage="
                    f"{self.zero_stage}: on TensorFlow, keras_tp runs data "
                    "parallelism and ZeRO on the devices of one host so far; "
                    "across workers use data_parallel=1, zero_stage=0 "
                    "(tensor parallelism), or the JAX backend."
                )
            strategy = _MULTI_WORKER_STRATEGY
            if self.world_size != strategy.num_replicas_in_sync:
                raise ValueError(
                    f"world_size={self.world_size}, but the multi-worker "
                    f"strategy has {strategy.num_replicas_in_sync} replicas; "
                    "leave world_size and device_ids unset."
                )
            first = strategy.cluster_resolver.task_id * len(
                strategy.extended.worker_devices
            )
        else:
            if self.data_parallel > 1:
                # TensorFlow ranks the members of a collective group by
                # device name. A mesh in that order makes each replica's
                # place in its row and in its column its rank there.
                self.devices = sorted(self.devices, key=_full_device_name)
                self.device_mesh = keras.distribution.DeviceMesh(
                    shape=(self.data_parallel, self.tensor_parallel),
                    axis_names=("data", "model"),
                    devices=self.devices,
                )
            strategy = _MirroredStrategy(
                [_full_device_name(d) for d in self.devices]
            )
            first = 0
        self.strategy = strategy
        # Global replica ids of this host's replicas, in component order.
        self._local_replicas = list(
            range(first, first + len(strategy.extended.worker_devices))
        )
        self._build_adapters()

    def _build_adapters(self):
        """The collectives of the `model`, `data` and both axes.

        Without a data axis the model axis is every replica and uses the
        strategy's `ReplicaContext`; with one, each axis gets collective
        groups of its own: the rows for `model`, the columns for `data`.
        """
        size, data, model = (
            self.world_size,
            self.data_parallel,
            self.tensor_parallel,
        )
        if data == 1:
            self.adapter = TensorFlowCollectiveAdapter(model)
            self.data_adapter = TensorFlowCollectiveAdapter(1, "data")
            self.world_adapter = TensorFlowCollectiveAdapter(
                size, ("data", "model")
            )
        else:
            groups = ReplicaGroups(
                self.strategy.extended.worker_devices,
                self.strategy._collective_key_base + _GROUP_KEY_OFFSET,
            )
            rows = [[d * model + m for m in range(model)] for d in range(data)]
            columns = [
                [d * model + m for d in range(data)] for m in range(model)
            ]
            self.adapter = TensorFlowCollectiveAdapter(
                model, groups=groups.split(rows)
            )
            self.data_adapter = TensorFlowCollectiveAdapter(
                data, "data", groups=groups.split(columns)
            )
            self.world_adapter = TensorFlowCollectiveAdapter(
                size, ("data", "model"), groups=groups.split([range(size)])
            )
        self.data_adapter.stats = self.adapter.stats
        self.world_adapter.stats = self.adapter.stats

    # Variables ---------------------------------------------------------

    def place_variable(self, variable, axis):
        self._store(variable, axis)

    def place_variable_like(self, variable, reference, data_axis):
        self._store(variable, self.placement.axes[id(variable)], data_axis)

    def partition_variable(self, variable, data_axis):
        self._store(
            variable,
            self.placement.axes[id(variable)],
            data_axis,
            full=self.full_value(variable),
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
        with tf.init_scope():
            if full is None:
                full = keras.ops.convert_to_numpy(variable.value)
            variable._value = self._per_replica_variable(
                variable, full, axis, data_axis
            )

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
        components = self._components(variable)
        axis = self.placement.split_axis(variable)
        data_axis = self.placement.data_axis(variable)
        if len(self._local_replicas) < self.world_size:
            # Several workers (there is no data axis then): the other
            # shards live on other hosts.
            if axis is None:
                return components[0].numpy()
            return self._gathered_across_hosts(variable, axis)
        model = self.tensor_parallel
        shards = []
        for model_rank in range(model if axis is not None else 1):
            partitions = [
                components[data_rank * model + model_rank].numpy()
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

    def _gathered_across_hosts(self, variable, axis):
        def gather():
            context = tf.distribute.get_replica_context()
            return context.all_gather(_local_read(variable), axis)

        gathered = tf.function(lambda: self.strategy.run(gather))()
        return self.strategy.experimental_local_results(gathered)[0].numpy()

    def assign_full_value(self, variable, value):
        value = np.asarray(value)
        pieces = self._local_shards(
            value,
            self.placement.split_axis(variable),
            self.placement.data_axis(variable),
        )
        for component, piece in zip(self._components(variable), pieces):
            component.assign(piece)

    def save_model(self, model, filepath, **kwargs):
        """Saves the unsplit model; on several workers only the chief writes.

        Every variable is assembled on the host for the time of the save.
        """
        with self._assembled(model.variables):
            if self._is_chief():
                model.save(filepath, **kwargs)
            else:
                logger.info(
                    "Worker is not the chief: %s not written.", filepath
                )

    def save_weights(self, model, filepath, **kwargs):
        """Saves the unsplit weights; on several workers only the chief."""
        with self._assembled(model.variables):
            if self._is_chief():
                model.save_weights(filepath, **kwargs)

    @contextlib.contextmanager
    def _assembled(self, variables):
        """Gives each placed variable a plain, full storage on the host."""
        storages = {}
        try:
            for variable in variables:
                if not self.placement.is_placed(variable):
                    continue
                full = self.full_value(variable)
                storages[id(variable)] = (variable, variable.value)
                with tf.device(_HOST):
                    variable._value = tf.Variable(
                        full, trainable=variable.trainable, name=variable.name
                    )
            yield
        finally:
            for variable, storage in storages.values():
                variable._value = storage

    def _is_chief(self):
        return _MULTI_WORKER_STRATEGY is None or self._local_replicas[0] == 0

    def device_bytes(self, variables):
        totals = {device: 0 for device in self.devices}
        for variable in variables:
            for component in self._components(variable):
                name = _device_name(component.device)
                totals[name] = totals.get(name, 0) + nbytes(component)
        return totals

    def replica_differences(self, variables):
        """Largest difference between the copies of each variable.

        Replicas holding the same piece (the data-parallel rows for a shard
        or a partition, and the model ranks of a replicated variable) must
        hold the same numbers.
        """
        differences = {}
        for variable in variables:
            axis = self.placement.split_axis(variable)
            data_axis = self.placement.data_axis(variable)
            copies = {}
            for replica, component in zip(
                self._local_replicas, self._components(variable)
            ):
                data_rank, model_rank = divmod(replica, self.tensor_parallel)
                piece = (
                    model_rank if axis is not None else None,
                    data_rank if data_axis is not None else None,
                )
                copies.setdefault(piece, []).append(component.numpy())
            differences[variable.path] = largest_difference(copies)
        return differences

    # Steps ---------------------------------------------------------------

    def run_step(self, phase, step, *args, **kwargs):
        """Runs one train / test / predict step over the replicas.

        `step` is Keras' own step; it is not called, because it assumes data
        parallelism of another kind (see the module docstring). The
        runtime's step keeps its contract: same data format, same loss,
        metrics and optimizer of the compiled model, same returned logs or
        predictions.
        """
        model = step.__self__
        if model.jit_compile:
            raise ValueError(
                "TensorParallelKeras on TensorFlow runs its replicas with "
                "tf.distribute, which XLA cannot compile as one program: "
                "call `compile(..., jit_compile=False)`."
            )
        if phase != "predict" and model.steps_per_execution > 1:
            # Keras loops such steps in a tf.while_loop, inside which
            # tf.distribute replicas fail to run (plain Keras too).
            raise ValueError(
                "TensorParallelKeras on TensorFlow runs one step per "
                "execution: call `compile(..., steps_per_execution=1)`."
            )
        steps = {
            "train": self._train_step,
            "test": self._test_step,
            "predict": self._predict_step,
        }
        with self.adapter.stats.recording(phase):
            data = self._batch_of_first_worker(*args, **kwargs)
            return self._traced(steps[phase])(model, data)

    def _traced(self, fn):
        """`fn`, traced when it would run eagerly and needs a graph.

        The collective groups of a data axis only run in graphs (see
        `ReplicaGroups`); an eager caller (`run_eagerly=True`, a direct
        call) gets `fn` traced anew on every call, so the collectives of
        every call are recorded.
        """
        if self.data_parallel > 1 and tf.executing_eagerly():
            return tf.function(fn)
        return fn

    def _batch_of_first_worker(self, data):
        """The batch every rank must see: worker 0's when there are several.

        Each worker process reads its own input; a shuffled order or other
        data on another worker would silently give its ranks other batches.
        One broadcast per input tensor (counted in the step's collectives)
        makes them all use worker 0's batch.
        """
        if len(self._local_replicas) == self.world_size:
            return data
        leaves = tf.nest.flatten(data)
        positions = [i for i, leaf in enumerate(leaves) if tf.is_tensor(leaf)]

        def from_first_worker(*tensors):
            return [self.adapter.broadcast(t, root=0) for t in tensors]

        tensors = self._on_replicas(
            from_first_worker, *[leaves[i] for i in positions]
        )
        for position, tensor in zip(positions, tensors):
            leaves[position] = tensor
        return tf.nest.pack_sequence_as(data, leaves)

    def _on_replicas(self, fn, *args):
        """Runs `fn` on every replica; returns this host's first result."""

        def run(*args):
            results = self.strategy.run(fn, args=args)
            return self.strategy.experimental_local_results(results)[0]

        return self._traced(run)(*args)

    @staticmethod
    def _replica_id():
        replica_id = (
            tf.distribute.get_replica_context().replica_id_in_sync_group
        )
        return int(tf.get_static_value(replica_id))

    def _in_replica(self):
        context = tf.distribute.get_replica_context()
        return context is not None and context.strategy is self.strategy

    def _forward(self, model, x, training, tapes=None):
        """Runs the model on every replica, each row on its slice of `x`.

        Args:
            model: the `TensorParallelKeras` model.
            x: the global batch of inputs.
            training: the `training` argument of the call.
            tapes: if given, each replica records its forward pass on a
                gradient tape kept here under its replica id.

        Returns:
            The output of each data-parallel row (that of its first model
            rank; the others hold the same), in row order.
        """
        x = self._checked_split(x)

        def forward(x):
            replica = self._replica_id()
            local_x = self._row_slice(x, replica // self.tensor_parallel)
            if tapes is None:
                return model(local_x, training=training)
            tape = tf.GradientTape()
            with tape:
                y_pred = model(local_x, training=training)
            tapes[replica] = (tape, y_pred)
            return y_pred

        with self._local_shapes(model):
            results = self.strategy.run(forward, args=(x,))
        local = self.strategy.experimental_local_results(results)
        return [
            local[row * self.tensor_parallel]
            for row in range(self.data_parallel)
        ]

    def _checked_split(self, x):
        """`x`, checked to split evenly over the data-parallel rows.

        A batch dimension unknown while tracing is checked when the step
        runs.
        """
        parts = self.data_parallel
        if parts == 1:
            return x

        def check(leaf):
            if not tf.is_tensor(leaf) or leaf.shape.rank == 0:
                return leaf
            if leaf.shape[0] is not None:
                self.check_batch_size(leaf.shape[0])
                return leaf
            assertion = tf.debugging.assert_equal(
                tf.shape(leaf)[0] % parts,
                0,
                message=(
                    f"A batch cannot be split evenly over data_parallel="
                    f"{parts} ranks. Use a batch size (and a dataset size, "
                    f"or `drop_remainder=True`) that divides by {parts}."
                ),
            )
            with tf.control_dependencies([assertion]):
                return tf.identity(leaf)

        return tf.nest.map_structure(check, x)

    def _row_slice(self, x, row):
        """Row `row`'s equal slice of every batched tensor of `x`."""
        parts = self.data_parallel
        if parts == 1:
            return x

        def piece(leaf):
            if not tf.is_tensor(leaf) or leaf.shape.rank == 0:
                return leaf
            size = leaf.shape[0]
            size = tf.shape(leaf)[0] // parts if size is None else size // parts
            return leaf[row * size : (row + 1) * size]

        return tf.nest.map_structure(piece, x)

    def _rows_together(self, rows):
        """The global batch's outputs from the rows' outputs."""
        if len(rows) == 1:
            return rows[0]
        return tf.nest.map_structure(
            lambda *parts: tf.concat(parts, axis=0), *rows
        )

    @contextlib.contextmanager
    def _local_shapes(self, model):
        """Makes the placed variables report the shapes replicas hold.

        Keras checks every `assign` against the variable's shape; inside a
        replica the values are shards and partitions.
        """
        variables = list(model.variables)
        # `optimizer` exists once the model is compiled.
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            variables += optimizer.variables
        placed = [v for v in variables if self.placement.is_placed(v)]
        # Replicas run in threads and may each enter: the first one in
        # sets the shapes, the last one out restores them.
        with self._shapes_lock:
            if not self._shapes_users:
                self._shapes_context = contextlib.ExitStack()
                self._shapes_context.enter_context(
                    local_shapes(placed, self.placement.local_shape)
                )
            self._shapes_users += 1
        try:
            yield
        finally:
            with self._shapes_lock:
                self._shapes_users -= 1
                if not self._shapes_users:
                    self._shapes_context.close()

    def _train_step(self, model, data):
        optimizer = self._prepare_optimizer(model)
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        # Each replica's forward tape, kept for its backward pass.
        tapes = {}
        rows = self._forward(model, x, training=True, tapes=tapes)
        _check_no_extra_losses(model)
        # The loss is computed once, outside the replicas, on the global
        # batch, so Keras neither divides it by the number of replicas nor
        # averages it over them.
        with tf.GradientTape() as loss_tape:
            loss_tape.watch(rows)
            y_pred = self._rows_together(rows)
            loss = model._compute_loss(
                x=x,
                y=y,
                y_pred=y_pred,
                sample_weight=sample_weight,
                training=True,
            )
            scaled_loss = optimizer.scale_loss(loss)
        model._loss_tracker.update_state(loss, sample_weight=_batch_size(x))
        # Times D, the gradient with respect to a row's output is that of
        # the row's own mean loss; the CoordinatedOptimizer's average over
        # `data` then makes the gradient of the global loss, for any loss.
        row_gradients = [
            tf.nest.map_structure(
                lambda g: g * tf.cast(self.data_parallel, g.dtype), gradient
            )
            for gradient in loss_tape.gradient(
                scaled_loss,
                rows,
                unconnected_gradients=tf.UnconnectedGradients.ZERO,
            )
        ]

        def backward_and_update(row_gradients):
            replica = self._replica_id()
            tape, local_y_pred = tapes.pop(replica)
            variables = model.trainable_variables
            gradients = tape.gradient(
                local_y_pred,
                variables,
                output_gradients=row_gradients[replica // self.tensor_parallel],
            )
            if self.per_rank_steps:
                gradients = _dense(gradients)
            if self.tensor_parallel > 1:
                gradients = self._replicated_from_first_replica(
                    gradients, variables
                )
            optimizer.apply(gradients, variables)
            if self.per_rank_steps:
                self._average_non_trainables(model)

        if model.trainable_variables:
            with self._local_shapes(model):
                self.strategy.run(backward_and_update, args=(row_gradients,))
        else:
            warnings.warn("The model does not have any trainable weights.")
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _replicated_from_first_replica(self, gradients, variables):
        """Gives every model rank the gradients of replicated variables
        that model rank 0 computed.

        Every rank computes the same gradient for a replicated variable,
        but TensorFlow does not promise the same bits on different devices
        (a reduction may round differently), and copies that drift apart
        are no longer one model. One broadcast per step and dtype, of all
        these gradients together, keeps the copies identical.
        """
        gradients = list(gradients)
        by_dtype = {}
        for i, (gradient, variable) in enumerate(zip(gradients, variables)):
            if (
                gradient is not None
                and self.placement.split_axis(variable) is None
            ):
                gradients[i] = tf.convert_to_tensor(gradient)
                by_dtype.setdefault(gradients[i].dtype, []).append(i)
        for indices in by_dtype.values():
            pieces = [gradients[i] for i in indices]
            flat = tf.concat([tf.reshape(p, [-1]) for p in pieces], axis=0)
            flat = self.adapter.broadcast_gradient(flat, root=0)
            sizes = [int(np.prod(p.shape)) for p in pieces]
            for i, piece, part in zip(indices, pieces, tf.split(flat, sizes)):
                gradients[i] = tf.reshape(part, piece.shape)
        return gradients

    def _average_non_trainables(self, model):
        """Averages the non-trainable float state over the data axis.

        BatchNorm statistics, say, which each row updated from its own
        slice of the batch; one all-reduce for all of them per dtype.
        """
        by_dtype = {}
        for variable in model.non_trainable_variables:
            floating = tf.as_dtype(variable.dtype).is_floating
            placed = self.placement.is_placed(variable)
            if (
                floating
                and placed
                and id(variable) not in self.placement.data_axes
            ):
                by_dtype.setdefault(variable.dtype, []).append(variable)
        for variables in by_dtype.values():
            values = [_local_read(v) for v in variables]
            flat = tf.concat([tf.reshape(v, [-1]) for v in values], axis=0)
            flat = self.data_adapter.all_reduce(flat, "mean")
            sizes = [int(np.prod(v.shape)) for v in values]
            for variable, value, part in zip(
                variables, values, tf.split(flat, sizes)
            ):
                variable.assign(tf.reshape(part, value.shape))

    def _test_step(self, model, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        y_pred = self._rows_together(self._forward(model, x, training=False))
        _check_no_extra_losses(model)
        loss = model._compute_loss(
            x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=False
        )
        model._loss_tracker.update_state(loss, sample_weight=_batch_size(x))
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _predict_step(self, model, data):
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        return self._rows_together(self._forward(model, x, training=False))

    def _prepare_optimizer(self, model):
        """Wraps and builds the compiled optimizer (once) for the replicas.

        With a data axis or ZeRO the compiled optimizer is a
        `CoordinatedOptimizer`; it and the optimizer inside it both become
        `TensorParallelOptimizer`s, the outer one placing its slots and
        gradient buffers with their ZeRO partitions.
        """
        optimizer = model.optimizer
        if not isinstance(optimizer, TensorParallelOptimizer):
            _check_optimizer_supported(optimizer, model, self)
            if optimizer.built:
                raise ValueError(
                    f"Optimizer '{optimizer.name}' is already built on other "
                    "variables. Give TensorParallelKeras.compile() a new "
                    "optimizer."
                )
            wrapped = [optimizer]
            if isinstance(optimizer, CoordinatedOptimizer):
                wrapped.append(optimizer.inner_optimizer)
            for each in wrapped:
                object.__setattr__(
                    each, "__class__", tensor_parallel_class(type(each))
                )
                object.__setattr__(each, "_tensor_parallel_runtime", self)
        elif optimizer._tensor_parallel_runtime is not self:
            raise ValueError(
                f"Optimizer '{optimizer.name}' belongs to another "
                "TensorParallelKeras model; compile with a new optimizer."
            )
        if not optimizer.built:

            def build():
                with keras.name_scope(optimizer.name, caller=optimizer):
                    optimizer.build(model.trainable_variables)
                # Iterations, learning rate and the like: a copy per replica,
                # since every replica steps its own optimizer.
                for variable in optimizer.variables:
                    if not self.placement.is_placed(variable):
                        self.placement.place(variable, None)

            _outside_distribution_context(build)
        return optimizer

    def call_model(self, model, inputs, training):
        """A direct call of the wrapped model (`tp(x)`).

        With a data axis or ZeRO the whole call runs in every replica, as
        in a step, since the mesh axes' collectives and ZeRO-3's gathers
        exist there only; each row computes the whole batch. So it does
        when a layer reads its split variables outside any region.
        """
        if self._in_replica():
            # A custom loop's replica step: values are the replica's own.
            with self._local_shapes(model):
                return model(inputs, training=training)
        if not (self.per_rank_steps or self._local_layers):
            return model(inputs, training=training)
        return self._on_replicas(
            lambda inputs: model(inputs, training=training), inputs
        )

    # Sharded regions -------------------------------------------------------

    def prepare_region(self, region):
        """Lets the region's Row layers take their input split."""
        region.accept_split_input()

    def prepare_local_layer(self, layer):
        # Its split variables can only be read inside a replica.
        self._local_layers = True

    def run_region(self, region, args, kwargs):
        if self._in_replica():
            return self._local_region(region, args, kwargs)
        return self._region_outside_replicas(region, args, kwargs)

    def gathered_call(self, layer, variables, call):
        """ZeRO-3: gathers the layer's partitions around its call.

        The gather's backward pass averages the gradient over `data` and
        reduce-scatters it. The tape keeps the gathered parameters for the
        backward pass, so they are gathered once per step (2 x the
        parameters communicated, not the 3 x of re-gathering), and stay
        alive from the layer's forward to its backward.
        """
        axes = [self.placement.data_axes[id(v)] for v in variables]

        def zero3_call(*args, **kwargs):
            if not self._in_replica():
                raise RuntimeError(
                    f"Layer '{layer.path}' holds ZeRO-3 partitions, which "
                    "are gathered only inside its TensorParallelKeras model: "
                    "call the model, or use predict()."
                )
            full = [
                self.data_adapter.gather_partitions(_local_read(v), axis)
                for v, axis in zip(variables, axes)
            ]
            with bind_values(zip(variables, full)):
                return call(*args, **kwargs)

        return zero3_call

    def _local_region(self, region, args, kwargs):
        """The region's output on this replica, from its local tensors."""
        first_input = args[0] if args else None
        input_axis = region.input_axis(args)
        leaves = tf.nest.flatten((args, kwargs))
        if region.parallel_input:
            copies = {}
            local = {}
            for leaf in leaves:
                split = leaf is first_input and input_axis is not None
                if _is_float_tensor(leaf) and not split:
                    copies[id(leaf)] = shared_value(
                        leaf, self.adapter.copy_to_parallel, local
                    )
            leaves = [copies.get(id(leaf), leaf) for leaf in leaves]
            args, kwargs = tf.nest.pack_sequence_as((args, kwargs), leaves)
        weights = [_local_read(variable) for variable, _ in region.variables()]
        with region.local_weights(weights), self.adapter.activated():
            return region.compute(*args, **kwargs)

    def _region_outside_replicas(self, region, args, kwargs):
        """Runs the region as its own replica step and gathers its outputs."""
        leaves = tf.nest.flatten((args, kwargs))
        tensor_positions = [
            i for i, leaf in enumerate(leaves) if tf.is_tensor(leaf)
        ]
        first_input = args[0] if args else None
        input_axis = region.input_axis(args)
        output_axes = region.output_axes(args, kwargs)

        def replica_step(*tensors):
            local = list(leaves)
            for position, tensor in zip(tensor_positions, tensors):
                if leaves[position] is first_input and input_axis is not None:
                    tensor = self.adapter.scatter_to_parallel(
                        tensor, input_axis
                    )
                local[position] = tensor
            local_args, local_kwargs = tf.nest.pack_sequence_as(
                (args, kwargs), local
            )
            outputs = self._local_region(region, local_args, local_kwargs)
            return _gather_split(self.adapter, outputs, output_axes)

        @tf.custom_gradient
        def sharded_call(*tensors):
            def grad(*upstream, variables=None):
                raise NotImplementedError(
                    f"Layer '{region.layer.path}' was called directly, outside "
                    "a TensorParallelKeras step, where keras_tp computes no "
                    "gradients on TensorFlow. Train with fit() or "
                    "train_on_batch()."
                )

            return self._on_replicas(replica_step, *tensors), grad

        return sharded_call(*[leaves[i] for i in tensor_positions])


class TensorParallelOptimizer:
    """Mixin that makes a Keras optimizer update tensor-parallel replicas.

    `TensorFlowRuntime` mixes it into the class of the compiled optimizer the
    first time the model trains (with a data axis or ZeRO, into the
    `CoordinatedOptimizer` and the optimizer it wraps). Each replica then
    applies its own gradients to its own components (shards, partitions,
    and copies of replicated variables) in replica context: gradients are
    never all-reduced by the TensorFlow optimizer's data-parallel path,
    because each replica already holds the exact gradient of what it owns
    (the `CoordinatedOptimizer` synchronises the data axis itself). Slot
    variables are split like the variable they belong to.
    """

    def add_variable_from_reference(
        self, reference_variable, name=None, initializer="zeros"
    ):
        runtime = self._tensor_parallel_runtime
        # Created whole on the host (not colocated with the per-replica
        # reference as the TensorFlow optimizer would), then split like its
        # reference, so no device holds a full slot.
        with tf.device(_HOST):
            variable = base_optimizer.BaseOptimizer.add_variable_from_reference(
                self, reference_variable, name=name, initializer=initializer
            )
        # With a data axis or ZeRO the CoordinatedOptimizer places it, with
        # its ZeRO partition.
        if not runtime.per_rank_steps:
            runtime.placement.place(
                variable, runtime.placement.split_axis(reference_variable)
            )
        return variable

    # A variable bound to a value (the ZeRO partition a
    # CoordinatedOptimizer updates, say) is written through Keras, which
    # records the write in the binding; any other one directly in this
    # replica's component.

    def assign(self, variable, value):
        if _is_bound(variable):
            variable.assign(value)
        else:
            super().assign(variable, value)

    def assign_add(self, variable, value):
        if _is_bound(variable):
            variable.assign_add(value)
        else:
            super().assign_add(variable, _scattered(value))

    def assign_sub(self, variable, value):
        if _is_bound(variable):
            variable.assign_sub(value)
        else:
            super().assign_sub(variable, _scattered(value))

    def _overwrite_model_variables_with_average_value(
        self, trainable_variables
    ):
        for variable, average in zip(
            trainable_variables, self._model_variables_moving_average
        ):
            self.assign(variable, average)

    def _var_key(self, variable):
        # The TensorFlow optimizer keys variables by their distributed
        # container, whose handle exists only inside a replica; this path
        # always passes Keras variables, which are their own key.
        return id(variable)

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        for grad, variable in zip(grads, trainable_variables):
            self.update_step(grad, variable, learning_rate)

    def _apply_weight_decay(self, variables):
        if self.weight_decay is None:
            return
        for variable in variables:
            if self._use_weight_decay(variable):
                lr = keras.ops.cast(self.learning_rate, variable.dtype)
                wd = keras.ops.cast(self.weight_decay, variable.dtype)
                # The optimizer's `assign_sub`, as a Keras variable's would
                # compare the local shard's shape with the full shape.
                self.assign_sub(variable, variable * wd * lr)


_TENSOR_PARALLEL_CLASSES = {}


def tensor_parallel_class(optimizer_class):
    """The subclass of `optimizer_class` with `TensorParallelOptimizer`."""
    if optimizer_class not in _TENSOR_PARALLEL_CLASSES:
        _TENSOR_PARALLEL_CLASSES[optimizer_class] = type(
            f"TensorParallel{optimizer_class.__name__}",
            (TensorParallelOptimizer, optimizer_class),
            {"__module__": __name__},
        )
    return _TENSOR_PARALLEL_CLASSES[optimizer_class]


def _scattered(value):
    """A sparse update (`tf.IndexedSlices`) as the dense tensor it adds.

    Per-replica (`ON_READ`) components take no scatter ops; the dense sum
    of the slices changes the same rows by the same amounts (repeated rows
    add up, as a scatter does). The optimizer's own sparse arithmetic
    (Adam touching only the rows seen) happens before, unchanged.
    """
    if isinstance(value, tf.IndexedSlices):
        return tf.convert_to_tensor(value)
    return value


def _dense(gradients):
    """The gradients with `tf.IndexedSlices` (of embeddings) made dense.

    The `CoordinatedOptimizer` sums a gradient over the data axis, which
    merges the rows of a token seen several times, as on JAX and torch.
    Keras on one device keeps the slices apart, and Adam's second moment and
    gradient norms then count each occurrence.
    """
    return [
        tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g
        for g in gradients
    ]


def _is_bound(variable):
    """Whether a Keras scope binds `variable` to a value of its own."""
    scope = get_stateless_scope()
    return scope is not None and scope.get_current_value(variable) is not None


def _check_optimizer_supported(optimizer, model, runtime):
    if optimizer is None:
        raise ValueError("The model has no optimizer: compile it first.")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer):
        raise NotImplementedError(
            "LossScaleOptimizer (mixed_float16) is not supported by "
            "keras_tp on TensorFlow yet; use float32 or bfloat16."
        )
    # A CoordinatedOptimizer takes norms across shards and accumulates
    # gradients itself.
    if not isinstance(optimizer, CoordinatedOptimizer):
        unsupported = {
            "clipnorm": optimizer.clipnorm,
            "global_clipnorm": optimizer.global_clipnorm,
            "use_ema": optimizer.use_ema,
            "gradient_accumulation_steps": (
                optimizer.gradient_accumulation_steps
            ),
        }
        used = [name for name, value in unsupported.items() if value]
        if used:
            raise NotImplementedError(
                f"Optimizer options {used} need norms or state across "
                "shards, which keras_tp on TensorFlow does not implement "
                "yet; remove them (clipvalue works)."
            )
    for variable in model.trainable_variables:
        if variable.regularizer is not None:
            raise NotImplementedError(
                f"Variable '{variable.path}' has a regularizer; keras_tp on "
                "TensorFlow does not support regularization losses yet."
            )
        split = runtime.placement.split_axis(variable) is not None or (
            runtime.zero_stage > 0
            and runtime.placement.partition_axis(variable) is not None
        )
        if split and variable.constraint is not None:
            raise NotImplementedError(
                f"Split variable '{variable.path}' has a constraint, which "
                "would act on one shard; keras_tp does not support it yet."
            )


def _outside_distribution_context(fn):
    """Runs `fn` eagerly in a fresh thread, outside any `tf.distribute` context.

    Steps are traced inside Keras' replica context of the default strategy,
    where TensorFlow refuses to create another strategy's variables, even
    under `tf.init_scope()` or `merge_call`. Distribution contexts belong to
    a thread, so a short-lived thread can create them.
    """
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as executor:
        return executor.submit(fn).result()


def _check_no_extra_losses(model):
    if model.losses:
        raise NotImplementedError(
            "The model adds losses in its forward pass (add_loss or activity "
            "regularization); keras_tp on TensorFlow does not support them "
            "yet."
        )


def _gather_split(adapter, outputs, axes):
    """Gathers each output left split along its axis (`None`: replicated)."""
    if axes is None:
        return outputs
    if isinstance(axes, int):
        return adapter.all_gather(outputs, axes)
    return type(outputs)(
        _gather_split(adapter, o, a) for o, a in zip(outputs, axes)
    )


def _local_read(variable):
    """This replica's value of a Keras variable, as a tensor.

    `tf.identity` rather than `tf.convert_to_tensor`: a multi-worker
    collective given the latter's result takes it for the distributed
    variable itself and fails.
    """
    return tf.identity(variable.value)


def _is_float_tensor(x):
    return tf.is_tensor(x) and x.dtype.is_floating


def _batch_size(x):
    first = next(i for i in tf.nest.flatten(x) if i is not None)
    return tf.shape(first)[0]


RUNTIME = TensorFlowRuntime
