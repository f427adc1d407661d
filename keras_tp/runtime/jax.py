"""JAX runtime: one controller, a `data x model` Mesh, `shard_map` regions.

Variables stay global Keras variables whose values are placed with a
`NamedSharding`, so each device stores only its shard and Keras' own JAX
trainer (jit, grad, optimizer) runs unchanged. A sharded region runs its
per-rank math in a small `jax.shard_map` over the mesh.
"""

import logging

import jax
import keras
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec
from keras.src.backend import StatelessScope
from keras.src.backend import get_keras_mask
from keras.src.backend import set_keras_mask

from keras_tp.collectives.jax import JaxCollectiveAdapter
from keras_tp.runtime.base import Runtime

logger = logging.getLogger(__name__)


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


def _is_array(value):
    return isinstance(value, (jax.Array, np.ndarray)) or (
        hasattr(value, "shape") and hasattr(value, "dtype")
    )


class JaxRuntime(Runtime):
    """Runs tensor parallelism on the devices of a `jax.sharding.Mesh`."""

    backend = "jax"

    def _available_devices(self):
        return keras.distribution.list_devices()

    def _build(self):
        devices = [_to_jax_device(d) for d in self.devices]
        grid = np.array(devices, dtype=object).reshape(
            self.data_parallel, self.tensor_parallel
        )
        # Mesh() keeps Auto axes; jax.make_mesh would make them Explicit.
        self.mesh = jax.sharding.Mesh(grid, ("data", "model"))
        self.adapter = JaxCollectiveAdapter(self.tensor_parallel)

    def place_variable(self, variable, axis):
        sharding = NamedSharding(self.mesh, _spec(axis))
        # Keras' JAX variables re-apply `_layout` on every assign, and the
        # optimizer gives each slot its reference variable's layout.
        variable._layout = sharding
        variable._direct_assign(variable.value)

    def full_value(self, variable):
        value = variable.value
        if not value.is_fully_addressable:
            # On several hosts every process gathers the shards it lacks.
            value = multihost_utils.process_allgather(value, tiled=True)
        return np.asarray(value)

    def save_model(self, model, filepath, **kwargs):
        self._write_on_process_zero(
            model, lambda: model.save(filepath, **kwargs)
        )

    def save_weights(self, model, filepath, **kwargs):
        self._write_on_process_zero(
            model, lambda: model.save_weights(filepath, **kwargs)
        )

    def _write_on_process_zero(self, model, write):
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
            placed = [(v._layout, v._value) for v in variables]
            try:
                for variable, value in zip(variables, full):
                    variable._layout = None
                    variable._direct_assign(jax.numpy.asarray(value))
                write()
            finally:
                for variable, (layout, value) in zip(variables, placed):
                    variable._layout = layout
                    variable._value = value
        multihost_utils.sync_global_devices("keras_tp: model written")

    def device_bytes(self, variables):
        totals = {str(d): 0 for d in self.mesh.devices.flat}
        for variable in variables:
            for shard in variable.value.addressable_shards:
                if str(shard.device) in totals:
                    totals[str(shard.device)] += shard.data.nbytes
        return totals

    def run_region(self, region, args, kwargs):
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
            local_masks = iter(local_masks)
            for array, mask in zip(local_arrays, masks):
                if mask is not None:
                    set_keras_mask(array, next(local_masks))
            if region.parallel_input:
                local_arrays = [
                    adapter.copy_to_parallel(a)
                    if spec == PartitionSpec()
                    and jax.numpy.issubdtype(a.dtype, jax.numpy.floating)
                    else a
                    for a, spec in zip(local_arrays, array_specs)
                ]
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


def _to_jax_device(name):
    platform, _, index = name.partition(":")
    for device in jax.devices(platform):
        if device.id == int(index):
            return device
    raise ValueError(f"No JAX device named '{name}'.")


RUNTIME = JaxRuntime
