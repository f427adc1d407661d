"""What every backend runtime provides to `TensorParallelKeras`."""

import contextlib
import functools
import logging
import time

import keras
import numpy as np
from keras import ops

from keras_tp.collectives.hierarchy import HierarchicalAdapter
from keras_tp.collectives.hierarchy import host_groups
from keras_tp.collectives.sequence import SequenceParallelAdapter
from keras_tp.collectives.sequence import region_inputs
from keras_tp.keras_internals import bind_values
from keras_tp.placement import Placement
from keras_tp.regions import copy_replicated_inputs
from keras_tp.regions import forward_pass
from keras_tp.runtime.pieces import CheckpointPieces
from keras_tp.tensors import collect_flat
from keras_tp.tensors import is_float

logger = logging.getLogger(__name__)


class Runtime(CheckpointPieces):
    """Owns the devices, the collective adapter and the variable storage.

    Subclasses decide how ranks exist (mesh devices or processes), how a
    variable's local shard is stored, and how a sharded region runs.

    Args:
        config: the `keras_tp.ParallelConfig` of its `data x model` mesh;
            its `world_size` of `None` means every device there is.
    """

    backend = None
    pipeline_parallel = 1
    # Whether each rank runs the code between split layers on its own
    # slices (so `auto_plan` must check the plan for that).
    local_ranks = True
    # What `compile(jit_compile=...)` defaults to; Keras' "auto" enables XLA
    # where the backend can compile the whole step.
    jit_compile_default = "auto"

    def __init__(self, config):
        devices = select_devices(
            self.backend,
            self._available_devices(),
            config.requested_world_size,
            config.device_ids,
        )
        self.config = config = config.on_devices(devices)
        self.zero_stage = config.zero_stage
        self.devices = devices
        self.world_size = len(devices)
        self.data_parallel = config.data_parallel
        self.tensor_parallel = config.tensor_parallel
        # With a data axis or ZeRO the whole step runs per rank, and the
        # CoordinatedOptimizer synchronises the data axis.
        self.per_rank_steps = self.data_parallel > 1 or self.zero_stage > 0
        self.placement = Placement(
            self.tensor_parallel, self.data_parallel, self
        )
        self.device_mesh = keras.distribution.DeviceMesh(
            shape=(self.data_parallel, self.tensor_parallel),
            axis_names=("data", "model"),
            devices=devices,
        )
        self._build()
        # `adapter` runs over the `model` axis, `data_adapter` over `data`
        # and `world_adapter` over both; they count into one stats object.
        self.adapter, self.data_adapter, self.world_adapter = (
            self._axis_adapters()
        )
        self.data_adapter.stats = self.adapter.stats
        self.world_adapter.stats = self.adapter.stats
        # The config checked that this backend runs it (see
        # `keras_tp.config.SUPPORT`).
        self.sequence_parallel = config.sequence_parallel
        if self.sequence_parallel:
            self.adapter = SequenceParallelAdapter(self.adapter)

    @property
    def stats(self):
        """The `CommunicationStats` every adapter of this runtime counts in."""
        return self.adapter.stats

    @property
    def optimizer_runtime(self):
        """The runtime a `CoordinatedOptimizer` binds to: this one where
        steps run per rank (a data axis or ZeRO), else `None` (the plain
        optimizer updates the placed variables)."""
        return self if self.per_rank_steps else None

    def bind_optimizer(self, optimizer):
        """Binds a `CoordinatedOptimizer` to this runtime's placement and
        to the collectives of its axes."""
        data_adapter = (
            self.hierarchical_data_adapter
            if optimizer.hierarchical
            else self.data_adapter
        )
        optimizer.bind(
            self.placement,
            data_adapter,
            self.world_adapter,
            self.time_data_all_reduce,
            self.adapter,
            self.run_on_ranks,
        )

    def stage_plans(self, plan):
        """`(part of plan, runtime)` pairs that install the plan's regions:
        here the whole plan, run by this runtime (a pipeline gives each
        stage's part to the runtime of its devices)."""
        return [(plan, self)]

    def prepare_trainer(self, trainer):
        """Called once with the `TensorParallelKeras` that runs the steps."""

    def check_compiled(self, trainer):
        """Called when `trainer` is compiled; refuses what cannot run."""

    def _available_devices(self):
        raise NotImplementedError

    def _build(self):
        """Creates the backend's mesh (devices, replicas or process ranks)."""
        raise NotImplementedError

    def _axis_adapters(self):
        """The collective adapters of the `model`, `data` and both axes.

        Returns:
            `(model_adapter, data_adapter, world_adapter)`.
        """
        raise NotImplementedError

    @functools.cached_property
    def hierarchical_data_adapter(self):
        """The `data` axis' collectives, within each host first.

        For `CoordinatedOptimizer(hierarchical=True)`. Where every data
        rank is on one host, or each on its own, there is no hierarchy and
        this is `data_adapter`.

        Raises:
            ValueError: if the hosts hold different numbers of data ranks,
                not consecutive ones, or group them differently for
                different tensor-parallel shards.
        """
        hosts = self._rank_hosts()
        model = self.tensor_parallel
        groupings = {
            str(host_groups(hosts[column::model])) for column in range(model)
        }
        within, across = host_groups(hosts[::model])
        if len(groupings) > 1:
            raise ValueError(
                "hierarchical=True needs the data ranks of every "
                "tensor-parallel shard grouped alike into hosts, but the "
                f"hosts of the ranks are {hosts} (data x model mesh, "
                "row-major). Put whole tensor-parallel groups on each host."
            )
        if len(within) == 1 or len(across) == 1:
            logger.info(
                "hierarchical=True: the %d data ranks sit on %d host(s), so "
                "the data axis is reduced in one level.",
                self.data_parallel,
                len(within),
            )
            return self.data_adapter
        adapter = HierarchicalAdapter(*self._level_adapters(within, across))
        adapter.stats = self.adapter.stats
        return adapter

    def time_data_all_reduce(self, nbytes, repeats):
        """Median seconds of an all-reduce of `nbytes` over `data`.

        For `bucket_cap_mb="auto"` (`keras_tp.parallel.bucket_probe`).
        Every rank returns the same number, so all choose alike.

        Args:
            nbytes: the size of each rank's float32 buffer, in bytes.
            repeats: timed calls, after one untimed warm-up call.
        """
        raise NotImplementedError

    def _rank_hosts(self):
        """The host of every rank, in mesh order (data-major)."""
        return [0] * self.world_size

    def _level_adapters(self, within, across):
        """Adapters of the data axis' groups within and across hosts.

        Args:
            within: lists of data ranks, one per host.
            across: lists of data ranks, one per place on a host.

        Returns:
            `(within_adapter, across_adapter)` for this rank's groups.
        """
        raise NotImplementedError

    def place_variable_like(self, variable, reference, data_axis):
        """Backend part of `Placement.place_like`."""
        raise NotImplementedError

    def partition_variable(self, variable, data_axis):
        """Backend part of `Placement.partition`."""
        raise NotImplementedError

    def store_per_replica(self, variable):
        """Backend part of `Placement.keep_per_replica`.

        The default does nothing: each rank stores its own copy of what it
        holds already (a process's tensor, a replica's component), so the
        copies can differ.
        """

    def run_on_ranks(self, fn, variables, phase):
        """Runs `fn()` on every rank outside a step, as steps run.

        For what a `CoordinatedOptimizer` does between steps (local SGD's
        last synchronisation of `fit()`): `fn` reads and assigns this
        rank's values of `variables` and may call the collectives of the
        mesh axes. The default calls it here, as a runtime of one process
        per rank runs its steps.

        Args:
            fn: function of no arguments.
            variables: every variable `fn` reads or assigns.
            phase: the phase its collectives are recorded under.
        """
        with self.adapter.stats.recording(phase):
            fn()

    def gathered_call(self, layer, variables, call):
        """Wraps a layer's `call` to gather its ZeRO-3 partitions around it.

        Inside, the layer reads each variable's full value, gathered over
        `data` by `gather_partitions`, whose backward pass reduce-scatters
        the gradient. How long the gathered values live is the backend's
        (`_gathered_partitions`).

        Args:
            layer: the layer.
            variables: the partitioned variables the call reads.
            call: the layer's call.

        Returns:
            A function with the signature of `call`.
        """
        axes = [self.placement.data_axes[id(v)] for v in variables]

        def zero3_call(*args, **kwargs):
            with self._gathered_partitions(layer, variables, axes) as full:
                if full is None:
                    return call(*args, **kwargs)
                with bind_values(zip(variables, full)):
                    return call(*args, **kwargs)

        return zero3_call

    def _gathered_partitions(self, layer, variables, axes):
        """Context giving the full values of `variables` (`None`: as they are).

        Args:
            layer: the layer about to run.
            variables: its partitioned variables.
            axes: the `data` axis each is partitioned on.
        """
        raise NotImplementedError

    def place_variable(self, variable, axis):
        """Backend part of `Placement.place`: the variable holds its shard."""
        raise NotImplementedError

    def full_value(self, variable):
        """The unsplit value of a placed variable, as a NumPy array."""
        return keras.ops.convert_to_numpy(variable.value)

    def assign_full_value(self, variable, value):
        """Assigns an unsplit `value` to a placed variable."""
        variable.assign(value)

    def save_model(self, model, filepath, **kwargs):
        """Writes the unsplit `model` with its current weights, and its
        optimizer's state where it holds the optimizer (a keras-hub task
        compiled by its own `compile`)."""
        variables = list(model.variables)
        optimizer = getattr(model, "optimizer", None)
        if optimizer is not None and optimizer.built:
            variables += optimizer.variables
        variables = [v for v in variables if self.placement.is_placed(v)]
        self._write_unsplit(
            model, variables, lambda: model.save(filepath, **kwargs)
        )

    def _write_unsplit(self, model, variables, write):
        """Runs `write` (a Keras save of `model`) where the placed
        `variables` it writes read whole.

        The default runs it as it is; runtimes whose ranks hold shards
        assemble the full values for the time of the write, on the one
        process that writes.
        """
        write()

    def check_batch_size(self, size):
        """Raises unless a global batch of `size` splits over the data axis."""
        if size % self.data_parallel:
            raise ValueError(
                f"A batch of {size} samples cannot be split evenly "
                f"over data_parallel={self.data_parallel} ranks. Use a batch "
                "size (and a dataset size, or `drop_remainder=True`) that "
                f"divides by {self.data_parallel}."
            )

    def synchronised_state(self, non_trainable, values, old_metrics, metrics):
        """Global metrics and data-averaged non-trainables, in one all-reduce.

        Every float piece is cast to float32, so that one all-reduce carries
        them all.

        Each data rank updated the metrics with its slice of the batch:
        their updates are summed over `data`, so the metrics are those of
        the global batch. Float non-trainable state (BatchNorm statistics)
        that is not partitioned is averaged over `data`.

        Args:
            non_trainable: the model's non-trainable variables.
            values: their values after this rank's step.
            old_metrics: the metric variables' values before the step.
            metrics: their values after this rank's step.

        Returns:
            `(new metric values, new non-trainable values)`.
        """
        pieces = [("sum", new - old) for old, new in zip(old_metrics, metrics)]
        for variable, value in zip(non_trainable, values):
            partitioned = self.placement.data_axis(variable) is not None
            averaged = is_float(value) and not partitioned
            pieces.append(("mean", value if averaged else None))
        floats = [
            (i, kind, piece)
            for i, (kind, piece) in enumerate(pieces)
            if piece is not None and is_float(piece)
        ]
        summed = {}
        if floats:
            pieces = [
                ops.cast(
                    piece / self.data_parallel if kind == "mean" else piece,
                    "float32",
                )
                for _, kind, piece in floats
            ]
            sums = collect_flat(
                pieces, lambda flat: self.data_adapter.all_reduce(flat, "sum")
            )
            for (i, _, piece), total in zip(floats, sums):
                summed[i] = ops.cast(total, piece.dtype)
        new_metrics = [
            old
            + (
                summed[i]
                if i in summed
                else self.data_adapter.all_reduce(new - old, "sum")
            )
            for i, (old, new) in enumerate(zip(old_metrics, metrics))
        ]
        offset = len(old_metrics)
        new_values = [
            summed.get(offset + i, value) for i, value in enumerate(values)
        ]
        return new_metrics, new_values

    def replica_differences(self, variables):
        """`{path: largest difference}` between copies that must be equal."""
        raise NotImplementedError

    def device_bytes(self, variables):
        """`{device: bytes}` these variables occupy, read from the arrays."""
        raise NotImplementedError

    def scope(self):
        """Context in which the model is wrapped and compiled.

        The default does nothing; a runtime whose backend needs its own
        scope (a `tf.distribute` strategy, say) returns it here.
        """
        return contextlib.nullcontext()

    def call_model(self, model, inputs, training):
        """Calls the wrapped `model` outside a step (`tp(x)`).

        The default calls it, recording its collectives under `"call"`; a
        runtime whose ranks only exist inside its steps runs the call
        there, and one that compiles its steps compiles the call too.
        """
        with self.recording_call():
            return model(inputs, training=training)

    @contextlib.contextmanager
    def recording_call(self):
        """The context of a direct call: its collectives are the `"call"`
        phase's, and its regions share the copies of replicated inputs."""
        with self.adapter.stats.recording("call"), forward_pass():
            yield

    def prepare_step_state(self, variables):
        """Called with every variable a step reads, before Keras makes it.

        The default does nothing; a runtime that compiles its steps for the
        placement of their inputs places every variable, so that no input
        changes placement after the first step (which would compile the
        step again).
        """

    def run_step(self, phase, step, *args, **kwargs):
        """Runs one Keras step function (`train_step`, ...) of `phase`.

        The default records the step's collectives under `phase` and calls
        Keras' own step; runtimes override it when their backend's step
        needs more (replica context, say).
        """
        with self.adapter.stats.recording(phase):
            return step(*args, **kwargs)

    def prepare_model(self, model):
        """Called once with the model when its plan is installed; no-op."""

    def prepare_region(self, region):
        """Called once per region when a plan is installed; default no-op."""

    def prepare_local_layer(self, layer):
        """Called once per layer that runs unchanged on split values.

        Such a layer (a `Channelwise` BatchNormalization) reads its split
        variables itself, outside any region; default no-op.
        """

    def run_region(self, region, args, kwargs):
        """Runs a `ShardedRegion`'s call on every rank; returns the output."""
        raise NotImplementedError

    def holds_local_values(self):
        """Whether the code running now sees one rank's tensors.

        True in a torch process; on JAX inside per-rank steps, on
        TensorFlow inside a replica. Elsewhere the values are global and a
        layer sees whole tensors.
        """
        return True

    def local_value(self, variable):
        """This rank's value of `variable` where ranks hold their own."""
        return variable.value

    def run_local_region(self, region, args, kwargs, enter=None):
        """Runs a region's per-rank math where the values are already local.

        For a rank that holds its own tensors (a torch process, a JAX device
        inside a per-rank step, a TensorFlow replica): replicated inputs
        enter the parallel part (`copy_replicated_inputs`), and the members
        read their variables' local values.

        Args:
            region: the `ShardedRegion`.
            args, kwargs: the region's call arguments, local to the rank.
            enter: the function a replicated input enters the parallel
                part through; by default the adapter's `copy_to_parallel`.

        Returns:
            The region's local outputs.
        """
        if region.parallel_input:
            args, kwargs = copy_replicated_inputs(
                region,
                enter or self.adapter.copy_to_parallel,
                args,
                kwargs,
                is_float,
            )
        weights = [self.local_value(v) for v, _ in region.variables()]
        with (
            region.local_weights(weights),
            self.adapter.activated(),
            region_inputs(region.main_input(args, kwargs)),
        ):
            return region.compute(*args, **kwargs)


def select_devices(backend, available, world_size, device_ids):
    """The devices a runtime of `world_size` uses, by name.

    Args:
        backend: the Keras backend's name, for messages.
        available: the names of the devices (or ranks) there are.
        world_size: how many to use; `None` means all.
        device_ids: explicit names, or `None`.

    Returns:
        The list of device names.
    """
    if device_ids is not None:
        device_ids = [str(d).lower() for d in device_ids]
        missing = [d for d in device_ids if d not in available]
        if missing:
            raise ValueError(
                f"device_ids {missing} are not available on the "
                f"{backend} backend; available: {available}."
            )
        if world_size is not None and world_size != len(device_ids):
            raise ValueError(
                f"world_size={world_size} but {len(device_ids)} "
                "device_ids were given; pass one or make them agree."
            )
        devices = device_ids
    else:
        if world_size is None:
            world_size = len(available)
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}.")
        if world_size > len(available):
            raise ValueError(
                f"world_size={world_size} is larger than the "
                f"{len(available)} {backend} device(s) available "
                f"({available}). keras_tp never runs several ranks on one "
                "device. On a CPU machine call "
                f"`keras_tp.configure_virtual_devices({world_size})` "
                "before any Keras operation, or lower world_size."
            )
        devices = available[:world_size]
    return devices


def largest_difference(copies):
    """Largest absolute difference within groups of copies of one piece.

    Args:
        copies: `{piece: [arrays that must be equal]}`.

    Returns:
        The largest difference to the first copy of its group, as a float.
    """
    worst = 0.0
    for group in copies.values():
        for other in group[1:]:
            difference = np.abs(np.asarray(other, "float64") - group[0])
            worst = max(worst, float(difference.max(initial=0.0)))
    return worst


def median_seconds(call, repeats):
    """Median wall time of `call()` over `repeats` calls after a warm-up.

    `call` must return only once its work is done (block on the result).
    """
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times))
