"""Devices of the TensorFlow runtime: the strategy and the mesh on it.

The replicas form the `data x model` mesh, replica `d * T + m` being model
rank `m` of data-parallel row `d`. The model axis runs over the replicas of
a row and the data axis over those of a column, each with collective groups
of its own (`ReplicaGroups`).
"""

import json
import logging
import os

import keras
import tensorflow as tf

from keras_tp import elastic
from keras_tp.collectives.tensorflow import TensorFlowCollectiveAdapter
from keras_tp.collectives.tensorflow_groups import ReplicaGroups
from keras_tp.runtime.base import median_seconds
from keras_tp.runtime.tensorflow import liveness

logger = logging.getLogger(__name__)

# The host's CPU, where full values are put together outside the replicas.
HOST = "/device:CPU:0"
_MULTI_WORKER_STRATEGY = None
# Group keys of the mesh axes start this far above the strategy's own.
_GROUP_KEY_OFFSET = 50000
# The first group key the next runtime on the multi-worker strategy takes.
_next_worker_group_key = 0


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


def configure_multi_worker(collective_timeout=None):
    """Creates the `MultiWorkerMirroredStrategy` described by `TF_CONFIG`.

    TensorFlow only configures cross-process collectives before its first
    operation, so a multi-worker program calls this first thing, on every
    worker; `TensorParallelKeras` then uses one replica per worker device.

    With a collective timeout, a collective that waits longer for another
    worker fails instead of hanging, and a worker that stops sending
    heartbeats for half of it (at most 10 s) is declared dead: the other
    workers raise a `keras_tp.RankLostError` that names it (as the
    uncaught error a worker's program ends with).

    Args:
        collective_timeout: seconds a collective waits for the other
            workers; default: `$KERAS_TP_COLLECTIVE_TIMEOUT` if set, else
            no limit (a dead worker is still named, after TensorFlow's 10 s
            heartbeat timeout; a live worker elsewhere is waited for).

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
        if collective_timeout is None:
            timeout = elastic.collective_timeout()
        else:
            timeout = elastic.check_collective_timeout(collective_timeout)
        liveness.prepare(timeout)
        _MULTI_WORKER_STRATEGY = tf.distribute.MultiWorkerMirroredStrategy(
            communication_options=(
                tf.distribute.experimental.CommunicationOptions(
                    timeout_seconds=timeout
                )
            )
        )
        liveness.watch(_MULTI_WORKER_STRATEGY)
    return _MULTI_WORKER_STRATEGY


def _tf_config_workers():
    config = json.loads(os.environ.get("TF_CONFIG") or "{}")
    return len(config.get("cluster", {}).get("worker", []))


def device_name(device):
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


def multi_worker_strategy():
    """The strategy `configure_multi_worker()` made, or `None`."""
    return _MULTI_WORKER_STRATEGY


def local_devices():
    """The names of this host's devices: its GPUs, else its (logical)
    CPUs."""
    if _tf_config_workers() > 1:
        raise RuntimeError(
            "TF_CONFIG describes several workers: call "
            "`keras_tp.runtime.tensorflow.configure_multi_worker()` at "
            "the start of the program, before any TensorFlow operation."
        )
    gpus = tf.config.list_logical_devices("GPU")
    devices = gpus or tf.config.list_logical_devices("CPU")
    return [device_name(device.name) for device in devices]


class ReplicaDevices:
    """Runtime mixin: the strategy, its replicas and the mesh axes' adapters.

    Also runs functions on the replicas, for the other parts of the runtime.
    """

    def _available_devices(self):
        if _MULTI_WORKER_STRATEGY is not None:
            return self._multi_worker_devices(_MULTI_WORKER_STRATEGY)
        return local_devices()

    @staticmethod
    def _multi_worker_devices(strategy):
        workers = strategy.cluster_resolver.cluster_spec().num_tasks("worker")
        local = [device_name(d) for d in strategy.extended.worker_devices]
        task = strategy.cluster_resolver.task_id
        return [
            name.replace(f"/task:{task}/", f"/task:{other}/")
            for other in range(workers)
            for name in local
        ]

    def _build_strategy(self):
        """Creates the strategy over the devices, in mesh order."""
        if _MULTI_WORKER_STRATEGY is not None:
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
            # TensorFlow ranks the members of a collective group by device
            # name. A mesh in that order makes each replica's place in its
            # row and in its column its rank there.
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

    def _axis_adapters(self):
        """The collectives of the `model`, `data` and both axes.

        Each axis gets collective groups of its own: the rows for `model`,
        the columns for `data`. Their gathers are one collective op, where
        the `ReplicaContext`'s gather its pieces' sizes first, then pads
        them, and takes 50 times as long to trace. Across workers, tensor
        parallelism alone (no step per rank) keeps the strategy's
        `ReplicaContext` over every replica, which also runs eagerly;
        with a data axis or ZeRO the groups span the workers, their
        members on this worker's devices (`ReplicaGroups`).
        """
        size, data, model = (
            self.world_size,
            self.data_parallel,
            self.tensor_parallel,
        )
        if _MULTI_WORKER_STRATEGY is not None and not self.per_rank_steps:
            self._axes_in_groups = False
            return (
                TensorFlowCollectiveAdapter(model),
                TensorFlowCollectiveAdapter(1, "data"),
                TensorFlowCollectiveAdapter(size, ("data", "model")),
            )
        self._axes_in_groups = True
        # Kept for the groups of `hierarchical=True` (`_level_adapters`).
        self._groups = groups = self._replica_groups()
        rows = [[d * model + m for m in range(model)] for d in range(data)]
        columns = [[d * model + m for d in range(data)] for m in range(model)]
        return (
            TensorFlowCollectiveAdapter(model, groups=groups.split(rows)),
            TensorFlowCollectiveAdapter(
                data, "data", groups=groups.split(columns)
            ),
            TensorFlowCollectiveAdapter(
                size, ("data", "model"), groups=groups.split([range(size)])
            ),
        )

    def _replica_groups(self):
        """The `ReplicaGroups` of this runtime's axes.

        On one host each strategy has keys of its own. Across workers every
        runtime shares the one strategy, so each takes the next block of
        keys after the last runtime's (its axes take at most `W + 2` and
        the two levels of `hierarchical=True` at most `2 W`); every worker
        builds the same models in the same order, so the keys agree
        between workers.
        """
        global _next_worker_group_key
        strategy = self.strategy
        first = strategy._collective_key_base + _GROUP_KEY_OFFSET
        if _MULTI_WORKER_STRATEGY is None:
            return ReplicaGroups(strategy.extended.worker_devices, first)
        local = strategy.extended.worker_devices
        task = f"/task:{strategy.cluster_resolver.task_id}/"
        # Replica r runs on device r % len(local) of worker r // len(local).
        devices = [
            local[r % len(local)].replace(task, f"/task:{r // len(local)}/")
            for r in range(self.world_size)
        ]
        first = max(first, _next_worker_group_key)
        _next_worker_group_key = first + 3 * self.world_size + 2
        return ReplicaGroups(devices, first, local=self._local_replicas)

    def _rank_hosts(self):
        """The worker of every replica, in mesh order: each worker runs
        as many replicas, in replica order."""
        per_worker = len(self._local_replicas)
        return [replica // per_worker for replica in range(self.world_size)]

    def _level_adapters(self, within, across):
        model = self.tensor_parallel

        def adapter(groups):
            # Data rank d of shard m is replica d * model + m.
            members = self._groups.split(
                [
                    [d * model + m for d in ranks]
                    for m in range(model)
                    for ranks in groups
                ]
            )
            return TensorFlowCollectiveAdapter(
                len(groups[0]), "data", groups=members
            )

        return adapter(within), adapter(across)

    def time_data_all_reduce(self, nbytes, repeats):
        adapter = self.data_adapter

        @tf.function
        def all_reduce():
            def replica_sum():
                return adapter.all_reduce(tf.zeros([nbytes // 4]), "sum")

            return self.strategy.run(replica_sum)

        def all_reduce_and_wait():
            # Reading a result waits for every replica's collective.
            for result in self.strategy.experimental_local_results(
                all_reduce()
            ):
                result.numpy()

        return median_seconds(all_reduce_and_wait, repeats)

    def _is_chief(self):
        return _MULTI_WORKER_STRATEGY is None or self._local_replicas[0] == 0

    def _traced(self, fn):
        """`fn`, traced when it would run eagerly and needs a graph.

        The collective groups of the mesh axes (all but those of tensor
        parallelism alone across workers) only run in graphs (see
        `ReplicaGroups`); an eager caller (`run_eagerly=True`, a direct
        call) gets `fn` traced anew on every call, so the collectives of
        every call are recorded.
        """
        if self._axes_in_groups and tf.executing_eagerly():
            return tf.function(fn)
        return fn

    def _on_replicas(self, fn, *args):
        """Runs `fn` on every replica; returns this host's first result."""

        def run(*args):
            results = self.strategy.run(fn, args=args)
            return self.strategy.experimental_local_results(results)[0]

        return self._traced(run)(*args)

    @staticmethod
    def replica_id():
        """The index of the replica running now, in a replica step."""
        replica_id = (
            tf.distribute.get_replica_context().replica_id_in_sync_group
        )
        return int(tf.get_static_value(replica_id))

    def _in_replica(self):
        context = tf.distribute.get_replica_context()
        return context is not None and context.strategy is self.strategy
