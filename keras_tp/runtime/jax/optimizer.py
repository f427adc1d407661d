"""Optimizer updates of whole arrays on the JAX runtime's mesh.

Keras' own optimizer updates global arrays: XLA runs each entry's update
where the entry is stored, and an optimizer that reads a whole variable
(Lamb's trust ratio, Adafactor's factored moments) reads all of it. What
the runtime adds are the data axis's collectives, issued per device
inside a `shard_map` in the `CoordinatedOptimizer`'s buckets
(`ZeroLayout`), and the squared norm of gradients laid out on the mesh.
A pipeline's stages update their variables so, each on its own mesh.
"""

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from keras_tp.parallel.clipping import weighted_squares
from keras_tp.parallel.optimizer import BUCKET_CAP_MB
from keras_tp.parallel.zero import ZeroLayout
from keras_tp.runtime.jax.storage import placement_spec
from keras_tp.runtime.jax.storage import replica_rows


class MeshUpdates:
    """The `JaxRuntime`'s updates of whole arrays (see the module)."""

    def over_replicas(self, update, variables):
        """An `update` of `variables`' whole arrays from the gradients'
        rows, one per replica: `(synchronise, update, specs)`.

        `synchronise` averages the rows over `data` (DDP) or, with ZeRO-1,
        reduce-scatters them, in the `CoordinatedOptimizer`'s buckets,
        laid out as `specs`; the returned `update` runs `update(values,
        *rest)` on each device's partition of the values and all-gathers
        the new ones (its first result).
        """
        placement = self.placement
        layout = ZeroLayout(
            placement, variables, self.zero_stage, BUCKET_CAP_MB * 2**20
        )
        placed = [self.variable_spec(v) for v in variables]
        partitioned = [
            placement_spec(
                len(placement.full_shapes[id(v)]),
                placement.split_axis(v),
                layout.partition_axes[id(v)],
            )
            for v in variables
        ]

        def reduced(rows):
            grads = [row[0] for row in rows]
            return layout.synchronised(grads, variables, self.data_adapter)

        def gathered(partitions):
            whole = layout.gathered(partitions, variables, self.data_adapter)
            return [whole.get(i, p) for i, p in enumerate(partitions)]

        gather = self.on_devices(gathered, partitioned, placed)

        def combined(values, *rest):
            values = [
                jax.lax.with_sharding_constraint(v, NamedSharding(self.mesh, s))
                for v, s in zip(values, partitioned)
            ]
            new_values, *new = update(values, *rest)
            return gather(new_values), *new

        rows = replica_rows(self, variables)
        synchronise = self.on_devices(reduced, rows, partitioned)
        return synchronise, combined, partitioned

    def squared_norm(self, variables, specs):
        """The squared norm of whole gradients of `variables`, laid out as
        `specs` say, from each device's pieces (`weighted_squares`)
        summed over the mesh."""

        def local(gradients):
            squares = weighted_squares(gradients, variables, self.placement)
            return self.world_adapter.all_reduce(sum(squares), "sum")

        return self.on_devices(local, specs, PartitionSpec())

    def on_devices(self, local, in_specs, out_specs):
        """`local` of one argument on each device of the mesh, its
        collectives counted as the optimizer's."""

        def labelled(values):
            with self.world_adapter.stats.labelled("optimizer"):
                return local(values)

        return jax.shard_map(
            labelled,
            mesh=self.mesh,
            in_specs=(in_specs,),
            out_specs=out_specs,
            check_vma=False,
        )
