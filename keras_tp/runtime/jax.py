"""JAX runtime: one controller, a `data x model` Mesh, `shard_map` regions.

Variables stay global Keras variables whose values are placed with a
`NamedSharding`, so each device stores only its shard.

- **Tensor parallelism only**: Keras' own JAX trainer (jit, grad,
  optimizer) runs unchanged, and a sharded region runs its per-rank math in
  a small `jax.shard_map` over the mesh.
- **With a data axis or ZeRO**: Keras' step function runs whole inside one
  `shard_map` that is manual over both axes, so every device computes its
  own loss on its slice of the batch and its own gradients, as a torch
  process would. Regions then run directly on the local values, and the
  `CoordinatedOptimizer` issues the data-axis collectives itself (nesting a
  region's `shard_map` inside would bind the `data` axis twice).
"""

import contextlib
import contextvars
import functools
import logging

import jax
import keras
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from keras_tp.collectives.jax import JaxCollectiveAdapter
from keras_tp.keras_internals import StatelessScope
from keras_tp.keras_internals import direct_assign
from keras_tp.keras_internals import get_keras_mask
from keras_tp.keras_internals import jax_layout
from keras_tp.keras_internals import local_shapes
from keras_tp.keras_internals import set_jax_layout
from keras_tp.keras_internals import set_keras_mask
from keras_tp.keras_internals import set_stored_value
from keras_tp.keras_internals import stored_value
from keras_tp.regions import shared_value
from keras_tp.runtime.base import Runtime
from keras_tp.runtime.base import is_float
from keras_tp.runtime.base import largest_difference

logger = logging.getLogger(__name__)

# The runtime whose per-rank step is being traced in this context.
_TRACING_RANKS_OF = contextvars.ContextVar("keras_tp_ranks", default=None)


def configure_virtual_devices(n):
    """Asks XLA for `n` CPU devices; must run before JAX initialises."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        have = len(jax.devices("cpu"))
        if have == n:
            return
        raise RuntimeError(
            f"JAX is already initialised with {have} CPU device(s), so "
            f"configure_virtual_devices({n}) cannot take effect. Call it "
            "right after `import keras_tp`, before any Keras or JAX "
            "operation (in a notebook: restart the kernel), or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={n}."
        )
    jax.config.update("jax_num_cpu_devices", n)
    if jax.default_backend() != "cpu":
        logger.info(
            "Accelerators found (%s): keras_tp will use them; the %d virtual "
            "CPU devices are only used if you pass their device_ids.",
            jax.default_backend(),
            n,
        )


def _spec(axis, axis_name="model"):
    """PartitionSpec splitting `axis` over `axis_name` (None: replicated)."""
    if axis is None:
        return PartitionSpec()
    return PartitionSpec(*([None] * axis), axis_name)


def _placement_spec(ndim, axis, data_axis):
    """Split `axis` over `model` and partition `data_axis` over `data`.

    On a shared axis the model shard is cut first, then partitioned.
    """
    spec = [None] * ndim
    if axis is not None:
        spec[axis] = "model"
    if data_axis is not None:
        spec[data_axis] = ("model", "data") if data_axis == axis else "data"
    return PartitionSpec(*spec)


def _is_array(value):
    return isinstance(value, (jax.Array, np.ndarray)) or (
        hasattr(value, "shape") and hasattr(value, "dtype")
    )


def _is_concrete(value):
    """An array with values now, not a tracer or a symbolic tensor."""
    return isinstance(value, (jax.Array, np.ndarray)) and not isinstance(
        value, jax.core.Tracer
    )


class JaxRuntime(Runtime):
    """Runs tensor parallelism on the devices of a `jax.sharding.Mesh`."""

    backend = "jax"

    @property
    def local_ranks(self):
        # Without a data axis, the code between regions runs on global
        # arrays, which any plan computes exactly.
        return self.per_rank_steps

    def _available_devices(self):
        return keras.distribution.list_devices()

    def _build(self):
        devices = [_to_jax_device(d) for d in self.devices]
        grid = np.array(devices, dtype=object).reshape(
            self.data_parallel, self.tensor_parallel
        )
        # Mesh() keeps Auto axes; jax.make_mesh would make them Explicit.
        self.mesh = jax.sharding.Mesh(grid, ("data", "model"))
        # Direct calls `tp(x)`, compiled once per `training` value.
        self._compiled_calls = {}

    def _axis_adapters(self):
        # A per-rank step runs without vma checks (see the module docstring).
        check_vma = not self.per_rank_steps
        return (
            JaxCollectiveAdapter(self.tensor_parallel, check_vma=check_vma),
            JaxCollectiveAdapter(self.data_parallel, "data", check_vma),
            JaxCollectiveAdapter(self.world_size, ("data", "model"), check_vma),
        )

    @functools.cached_property
    def _copies_per_device(self):
        return self.adapter.copies_per_device(self.mesh)

    def place_variable(self, variable, axis):
        self._lay_out(variable)

    def place_variable_like(self, variable, reference, data_axis):
        self._lay_out(variable, data_axis)

    def partition_variable(self, variable, data_axis):
        self._lay_out(variable, data_axis)

    def _lay_out(self, variable, data_axis=None):
        spec = _placement_spec(
            len(self.placement.full_shapes[id(variable)]),
            self.placement.axes[id(variable)],
            data_axis,
        )
        # Keras' JAX variables re-apply `_layout` on every assign, and the
        # optimizer gives each slot its reference variable's layout.
        set_jax_layout(variable, NamedSharding(self.mesh, spec))
        direct_assign(variable, variable.value)

    def _variable_spec(self, variable):
        if id(variable) not in self.placement.full_shapes:
            return PartitionSpec()
        return _placement_spec(
            len(self.placement.full_shapes[id(variable)]),
            self.placement.axes[id(variable)],
            self.placement.data_axis(variable),
        )

    def full_value(self, variable):
        value = variable.value
        if not value.is_fully_addressable:
            # On several hosts every process gathers the shards it lacks.
            value = multihost_utils.process_allgather(value, tiled=True)
        return np.asarray(value)

    def _write_unsplit(self, model, write):
        """Runs `write` with full weights; on several hosts process 0 writes.

        One process reads global arrays directly. On several hosts the
        arrays span devices this process cannot read, so every process
        gathers them, process 0 writes while its variables hold the full
        values on the host, and all processes wait for it.
        """
        if jax.process_count() == 1:
            write()
            return
        variables = model.variables
        full = [self.full_value(v) for v in variables]
        if jax.process_index() == 0:
            placed = [(jax_layout(v), stored_value(v)) for v in variables]
            try:
                for variable, value in zip(variables, full):
                    set_jax_layout(variable, None)
                    direct_assign(variable, jax.numpy.asarray(value))
                write()
            finally:
                for variable, (layout, value) in zip(variables, placed):
                    set_jax_layout(variable, layout)
                    set_stored_value(variable, value)
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
        the same numbers.
        """
        differences = {}
        for variable in variables:
            copies = {}
            for shard in variable.value.addressable_shards:
                key = tuple((s.start, s.stop) for s in shard.index)
                copies.setdefault(key, []).append(np.asarray(shard.data))
            differences[variable.path] = largest_difference(copies)
        return differences

    def local_pieces(self, variable):
        """The first copy of each of the variable's shards held here."""
        value = variable.value
        return [
            (
                str(shard.device).replace(":", ""),
                _index(shard.index, value.shape),
                np.asarray(shard.data),
            )
            for shard in value.addressable_shards
            if shard.replica_id == 0
        ]

    def assign_local_pieces(self, variable, read):
        value = variable.value
        if jax_layout(variable) is None:
            # Not laid out on the mesh (an iteration count): JAX places
            # such a value where each computation needs it.
            variable.assign(read(_index((), value.shape)))
            return
        placed = jax.make_array_from_callback(
            value.shape,
            value.sharding,
            lambda index: read(_index(index, value.shape)),
        )
        direct_assign(variable, placed)

    def process_index(self):
        return jax.process_index()

    def wait_for_processes(self):
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("keras_tp: checkpoint")

    # Per-rank steps (data axis, ZeRO) ----------------------------------

    def run_step(self, phase, step, *args, **kwargs):
        if not self.per_rank_steps:
            return super().run_step(phase, step, *args, **kwargs)
        state, data = args
        model = step.__self__
        with self.adapter.stats.recording(phase):
            return self._per_rank_step(phase, model, step, state, data)

    def _per_rank_step(self, phase, model, step, state, data):
        """Runs Keras' step on every device, on that device's values.

        The state enters with the placement of each variable, the batch
        split over `data`; the metrics' updates are summed over `data` and
        the non-trainable variables (BatchNorm statistics) averaged, in one
        all-reduce, so the logs are those of the global batch.
        """
        groups = [model.trainable_variables, model.non_trainable_variables]
        if phase == "train":
            groups.append(model.optimizer.variables)
        if phase != "predict":
            groups.append(model.metrics_variables)
        state_specs = tuple(
            [self._variable_spec(v) for v in group] for group in groups
        )
        data_specs = jax.tree_util.tree_map(self._batch_spec, data)
        placed = [
            v for group in groups for v in group if self.placement.is_placed(v)
        ]

        def per_rank(state, data):
            with (
                local_shapes(placed, self.placement.local_shape),
                self._ranks(),
            ):
                if phase == "predict":
                    return step(state, data)
                logs, new_state = step(state, data)
                new_state = list(new_state)
                metrics, non_trainable = self.synchronised_state(
                    groups[1], new_state[1], state[-1], new_state[-1]
                )
                new_state[1], new_state[-1] = non_trainable, metrics
                mapping = list(zip(groups[-1], metrics))
                with StatelessScope(state_mapping=mapping):
                    logs = model.get_metrics_result()
                return logs, tuple(new_state)

        out_specs = (
            PartitionSpec("data")
            if phase == "predict"
            else (PartitionSpec(), state_specs)
        )
        mapped = jax.shard_map(
            per_rank,
            mesh=self.mesh,
            in_specs=(state_specs, data_specs),
            out_specs=out_specs,
            check_vma=False,
        )
        return mapped(tuple(state), data)

    def call_model(self, model, inputs, training):
        """A direct call `tp(x)` on concrete arrays runs compiled.

        Run eagerly, each region's `shard_map` would be traced and compiled
        again at every call (seconds per call for a keras-hub model); the
        whole call is compiled once instead, as Keras compiles `predict`.
        Inside a trace (a step, a user's `jax.jit`) the call is traced as
        part of it.
        """
        leaves = jax.tree_util.tree_leaves(inputs)
        if self._inside_ranks or not all(map(_is_concrete, leaves)):
            return super().call_model(model, inputs, training)
        compiled = self._compiled_calls.get(training)
        if compiled is None:
            compiled = jax.jit(
                functools.partial(self._stateless_call, model, training)
            )
            self._compiled_calls[training] = compiled
        values = [v.value for v in model.variables]
        outputs, non_trainable = compiled(values, inputs)
        # A forward pass updates only non-trainable state (BatchNorm
        # statistics, dropout seeds).
        for variable, value in zip(model.non_trainable_variables, non_trainable):
            variable.assign(value)
        return outputs

    def _stateless_call(self, model, training, values, inputs):
        with StatelessScope(
            state_mapping=list(zip(model.variables, values))
        ) as scope:
            outputs = super().call_model(model, inputs, training)
        non_trainable = [
            scope.get_current_value(v) for v in model.non_trainable_variables
        ]
        return outputs, non_trainable

    def _batch_spec(self, leaf):
        if not _is_array(leaf) or len(leaf.shape) == 0:
            return PartitionSpec()
        self.check_batch_size(leaf.shape[0])
        return PartitionSpec("data")

    @contextlib.contextmanager
    def _ranks(self):
        """Marks the tracing of a per-rank step (regions run locally)."""
        token = _TRACING_RANKS_OF.set(self)
        try:
            yield
        finally:
            _TRACING_RANKS_OF.reset(token)

    @property
    def _inside_ranks(self):
        return _TRACING_RANKS_OF.get() is self

    @contextlib.contextmanager
    def _gathered_partitions(self, layer, variables, axes):
        """Gathers inside per-rank steps, where each device holds a partition.

        Elsewhere (a call on global arrays) the values are whole already.
        The gathered parameters are not rematerialised for the backward
        pass: JAX can emit the re-gather (`jax.checkpoint`), but XLA merges
        it with the forward gather, so one gather per parameter and step is
        what runs (2 x the parameters communicated per step, not 3 x).
        """
        if not self._inside_ranks:
            yield None
            return
        gather = self.data_adapter.gather_partitions
        yield [gather(v.value, axis) for v, axis in zip(variables, axes)]

    def prepare_region(self, region):
        """In per-rank steps Row layers receive their input split."""
        if self.per_rank_steps:
            region.accept_split_input()

    def run_region(self, region, args, kwargs):
        if self._inside_ranks:
            return self.run_local_region(region, args, kwargs)
        leaves, treedef = jax.tree_util.tree_flatten(
            (args, kwargs), is_leaf=lambda x: x is None
        )
        first_input = args[0] if args else None
        array_index = {}
        arrays = []
        for leaf in leaves:
            if _is_array(leaf) and id(leaf) not in array_index:
                array_index[id(leaf)] = len(arrays)
                arrays.append(leaf)
        input_axis = region.input_axis(args)
        array_specs = [
            _spec(input_axis) if a is first_input else PartitionSpec()
            for a in arrays
        ]
        # Replicated float inputs of a region with split weights enter as
        # one copy per device, shared by every region that reads them in
        # this call, so their gradient is all-reduced once (Megatron `f`).
        per_device = [
            region.parallel_input and spec == PartitionSpec() and is_float(a)
            for a, spec in zip(arrays, array_specs)
        ]
        arrays = [
            shared_value(a, self._copies_per_device) if copy else a
            for a, copy in zip(arrays, per_device)
        ]
        array_specs = [
            PartitionSpec("model") if copy else spec
            for copy, spec in zip(per_device, array_specs)
        ]
        masks = [get_keras_mask(a) for a in arrays]
        mask_arrays = [m for m in masks if m is not None]
        variables = region.variables()
        weights = [variable.value for variable, _ in variables]
        weight_specs = [_spec(axis) for _, axis in variables]
        # Other state the layer's own call may read or update (the seed of
        # an attention dropout, say) enters and leaves the region
        # explicitly: a value traced inside shard_map must not leak out.
        member_ids = {id(variable) for variable, _ in variables}
        state = [v for v in region.layer.variables if id(v) not in member_ids]
        out_axes = region.output_axes(args, kwargs)
        out_specs = jax.tree_util.tree_map(
            _spec, out_axes, is_leaf=lambda x: x is None or isinstance(x, int)
        )
        adapter = self.adapter

        def local_fn(local_arrays, local_masks, local_weights, local_state):
            local_arrays = [
                a[0] if copy else a for a, copy in zip(local_arrays, per_device)
            ]
            local_masks = iter(local_masks)
            for array, mask in zip(local_arrays, masks):
                if mask is not None:
                    set_keras_mask(array, next(local_masks))
            local_leaves = [
                local_arrays[array_index[id(leaf)]]
                if id(leaf) in array_index
                else leaf
                for leaf in leaves
            ]
            local_args, local_kwargs = jax.tree_util.tree_unflatten(
                treedef, local_leaves
            )
            with (
                StatelessScope(
                    state_mapping=list(zip(state, local_state))
                ) as scope,
                region.local_weights(local_weights),
                adapter.activated(),
            ):
                outputs = region.compute(*local_args, **local_kwargs)
            return outputs, [scope.get_current_value(v) for v in state]

        mapped = jax.shard_map(
            local_fn,
            mesh=self.mesh,
            in_specs=(
                array_specs,
                [PartitionSpec()] * len(mask_arrays),
                weight_specs,
                [PartitionSpec()] * len(state),
            ),
            out_specs=(out_specs, [PartitionSpec()] * len(state)),
            check_vma=True,
        )
        outputs, new_state = mapped(
            arrays, mask_arrays, weights, [v.value for v in state]
        )
        for variable, value in zip(state, new_state):
            variable.assign(value)
        return outputs


def _index(slices, shape):
    """A shard's `index` (slices, open-ended or missing) as `(start, stop)`s."""
    slices = tuple(slices) + (slice(None),) * (len(shape) - len(slices))
    return tuple(
        (s.start or 0, size if s.stop is None else s.stop)
        for s, size in zip(slices, shape)
    )


def _to_jax_device(name):
    platform, _, index = name.partition(":")
    for device in jax.devices(platform):
        if device.id == int(index):
            return device
    raise ValueError(f"No JAX device named '{name}'.")


RUNTIME = JaxRuntime
