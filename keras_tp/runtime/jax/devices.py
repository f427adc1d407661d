"""The devices of the JAX runtime: a `data x model` Mesh and its axes.

One controller drives every device of the mesh; under `jax.distributed`
each process drives its own devices of one global mesh. Virtual CPU
devices come from `jax_num_cpu_devices`, which must be set before JAX
initialises.
"""

import logging

import jax
import keras
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from keras_tp.collectives.jax import JaxCollectiveAdapter
from keras_tp.runtime.base import median_seconds

logger = logging.getLogger(__name__)


def configure_virtual_devices(n):
    """Asks XLA for `n` CPU devices; must run before JAX initialises."""
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        # This process' devices: under jax.distributed, jax.devices() also
        # lists the other processes'.
        have = len(jax.local_devices(backend="cpu"))
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


def to_jax_device(name):
    """The JAX device of a Keras device name such as `"cpu:0"`."""
    platform, _, index = name.partition(":")
    for device in jax.devices(platform):
        if device.id == int(index):
            return device
    raise ValueError(f"No JAX device named '{name}'.")


class MeshDevices:
    """The `JaxRuntime`'s mesh and the collectives of its axes."""

    @property
    def local_ranks(self):
        # Without a data axis, the code between regions runs on global
        # arrays, which any plan computes exactly.
        return self.per_rank_steps

    def _available_devices(self):
        return keras.distribution.list_devices()

    def _build_mesh(self):
        devices = [to_jax_device(d) for d in self.devices]
        grid = np.array(devices, dtype=object).reshape(
            self.data_parallel, self.tensor_parallel
        )
        # Mesh() keeps Auto axes; jax.make_mesh would make them Explicit.
        self.mesh = jax.sharding.Mesh(grid, ("data", "model"))

    def _axis_adapters(self):
        # A per-rank step runs without vma checks (see `steps`).
        check_vma = not self.per_rank_steps
        return (
            JaxCollectiveAdapter(self.tensor_parallel, check_vma=check_vma),
            JaxCollectiveAdapter(self.data_parallel, "data", check_vma),
            JaxCollectiveAdapter(self.world_size, ("data", "model"), check_vma),
        )

    def _rank_hosts(self):
        return [device.process_index for device in self.mesh.devices.flat]

    def _level_adapters(self, within, across):
        check_vma = not self.per_rank_steps
        return tuple(
            JaxCollectiveAdapter(len(groups[0]), "data", check_vma, groups)
            for groups in (within, across)
        )

    def time_data_all_reduce(self, nbytes, repeats):
        # One row per device; psum over `data` reduces within each column.
        axes = PartitionSpec(("data", "model"))
        sum_over_data = jax.jit(
            jax.shard_map(
                lambda row: jax.lax.psum(row, "data"),
                mesh=self.mesh,
                in_specs=axes,
                out_specs=axes,
            )
        )
        rows = jax.device_put(
            np.zeros((self.world_size, nbytes // 4), "float32"),
            NamedSharding(self.mesh, axes),
        )
        return median_seconds(
            lambda: sum_over_data(rows).block_until_ready(), repeats
        )
