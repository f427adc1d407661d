"""`MeshRuntime`: the `data x model` mesh of tensor and data parallelism.

Each backend subclasses it (`keras_tp.runtime.<backend>`) and supplies
its primitives: how ranks exist (mesh devices, processes, replicas), how
a variable's shard is stored, and how a sharded region runs. What every
backend shares is written here once, and the table in the architecture
guide lists it.
"""

import contextlib

import keras
from keras import ops

from keras_tp.collectives.sequence import SequenceParallelAdapter
from keras_tp.collectives.sequence import region_inputs
from keras_tp.keras_internals import bind_values
from keras_tp.placement import Placement
from keras_tp.regions import copy_replicated_inputs
from keras_tp.regions import forward_pass
from keras_tp.runtime.base import Runtime
from keras_tp.runtime.data_axis import DataAxisLevels
from keras_tp.tensors import collect_flat
from keras_tp.tensors import is_float


class MeshRuntime(DataAxisLevels, Runtime):
    """A runtime over a `data x model` mesh of devices (or ranks).

    It owns the collective adapters of the mesh's axes, stores each
    variable's shard, and runs the sharded regions of the plan's split
    layers; a `CoordinatedOptimizer` binds to it for the data axis.

    Args:
        config: the `keras_tp.ParallelConfig` of its `data x model` mesh.
    """

    def __init__(self, config):
        super().__init__(config)
        # With a data axis or ZeRO the whole step runs per rank, and the
        # CoordinatedOptimizer synchronises the data axis.
        self.per_rank_steps = self.data_parallel > 1 or self.zero_stage > 0
        self.placement = Placement(
            self.tensor_parallel, self.data_parallel, self
        )
        self.device_mesh = keras.distribution.DeviceMesh(
            shape=(self.data_parallel, self.tensor_parallel),
            axis_names=("data", "model"),
            devices=self.devices,
        )
        self._build()
        self._make_adapters()

    def _make_adapters(self):
        # `adapter` runs over the `model` axis, `data_adapter` over `data`
        # and `world_adapter` over both; they count into one stats object.
        self.adapter, self.data_adapter, self.world_adapter = (
            self._axis_adapters()
        )
        self.data_adapter.stats = self.adapter.stats
        self.world_adapter.stats = self.adapter.stats
        if self.sequence_parallel:
            self.adapter = SequenceParallelAdapter(self.adapter)

    def run_steps_per_rank(self, per_rank=True):
        """Runs every step per rank from now on, as with a data axis.

        For a plan whose whole layers get partial gradients that XLA
        would sum on global arrays in collectives of its own
        (`ShardingPlan.summed_by_xla`): per rank, their weights' gradients
        are summed in counted all-reduces; and for Columns that pair by
        blocks (`ShardingPlan.paired_by_blocks`). Called before the model
        is split; the adapters are made anew for per-rank steps.

        Args:
            per_rank: `False` goes back to global arrays, where a plan
                made for per-rank steps gained nothing from them (a model
                without a data axis only).

        Returns:
            Whether the steps run as asked now: not per rank under
            sequence parallelism, whose shards run on global arrays only.
        """
        if self.sequence_parallel and per_rank:
            return False
        self.per_rank_steps = per_rank
        self._make_adapters()
        return True

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

    def _build(self):
        """Creates the backend's mesh (devices, replicas or process ranks)."""
        raise NotImplementedError

    def _axis_adapters(self):
        """The collective adapters of the `model`, `data` and both axes.

        Returns:
            `(model_adapter, data_adapter, world_adapter)`.
        """
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

    @contextlib.contextmanager
    def generating(self, model):
        """Inside, the task `model` generates on the ranks: by default as
        it is (its regions run on the ranks)."""
        yield

    def split_on_model(self, value, axis):
        """A whole tensor, split on `axis` over the model ranks as they
        hold it: here a rank's own slice (a generation's key/value cache,
        made whole by the task, enters its layer so)."""
        return self.adapter.scatter_to_parallel(value, axis)

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
