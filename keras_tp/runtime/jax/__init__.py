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

`JaxRuntime` is put together from one mixin per part, with the same file
names as the other backends' runtimes:

- `devices`: the mesh of devices and the collectives of its axes;
- `storage`: global arrays laid out on the mesh; full values, checkpoint
  pieces and the bytes on each device;
- `steps`: Keras' steps and direct calls on the mesh;
- `regions`: where and how a split layer's call runs;
- `optimizer`: updates of whole arrays over the data axis.
"""

from keras_tp.runtime.jax.devices import MeshDevices
from keras_tp.runtime.jax.devices import configure_virtual_devices
from keras_tp.runtime.jax.optimizer import MeshUpdates
from keras_tp.runtime.jax.regions import MeshRegions
from keras_tp.runtime.jax.steps import MeshSteps
from keras_tp.runtime.jax.storage import MeshStorage
from keras_tp.runtime.mesh import MeshRuntime

__all__ = ["RUNTIME", "JaxRuntime", "configure_virtual_devices"]


class JaxRuntime(
    MeshDevices, MeshStorage, MeshSteps, MeshRegions, MeshUpdates, MeshRuntime
):
    """Runs tensor parallelism on the devices of a `jax.sharding.Mesh`."""

    backend = "jax"

    @property
    def stores_blocks(self):
        # Only where steps run per rank: on global arrays the code between
        # regions would read a blocked Column's output in its stored
        # (permuted) layout.
        return self.per_rank_steps

    def _build(self):
        self._build_mesh()
        # Direct calls `tp(x)`, compiled once per `training` value.
        self._compiled_calls = {}


RUNTIME = JaxRuntime
