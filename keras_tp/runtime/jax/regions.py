"""Sharded regions on the mesh: a split layer's call as a `shard_map`.

Outside per-rank steps a region runs its per-rank math in a small
`jax.shard_map` over the `model` axis, on global arrays. Inside a per-rank
step (a data axis or ZeRO), which is one `shard_map` over both axes already,
it runs directly on the local values (`Runtime.run_local_region`).
"""

import contextlib
import contextvars

import jax
import numpy as np
from jax.sharding import PartitionSpec

from keras_tp.keras_internals import StatelessScope
from keras_tp.keras_internals import get_keras_mask
from keras_tp.keras_internals import set_keras_mask
from keras_tp.regions import shared_value
from keras_tp.runtime.base import is_float

# The runtime whose per-rank step is being traced in this context.
TRACING_RANKS_OF = contextvars.ContextVar("keras_tp_ranks", default=None)


def spec(axis, axis_name="model"):
    """PartitionSpec splitting `axis` over `axis_name` (None: replicated)."""
    if axis is None:
        return PartitionSpec()
    return PartitionSpec(*([None] * axis), axis_name)


def is_array(value):
    return isinstance(value, (jax.Array, np.ndarray)) or (
        hasattr(value, "shape") and hasattr(value, "dtype")
    )


class MeshRegions:
    """The `JaxRuntime`'s regions, and where they run (see the module)."""

    @contextlib.contextmanager
    def _ranks(self):
        """Marks the tracing of a per-rank step (regions run locally)."""
        token = TRACING_RANKS_OF.set(self)
        try:
            yield
        finally:
            TRACING_RANKS_OF.reset(token)

    @property
    def _inside_ranks(self):
        return TRACING_RANKS_OF.get() is self

    def holds_local_values(self):
        return self._inside_ranks

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
            if is_array(leaf) and id(leaf) not in array_index:
                array_index[id(leaf)] = len(arrays)
                arrays.append(leaf)
        input_axis = region.input_axis(args)
        array_specs = [
            spec(input_axis) if a is first_input else PartitionSpec()
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
        weight_specs = [spec(axis) for _, axis in variables]
        # Other state the layer's own call may read or update (the seed of
        # an attention dropout, say) enters and leaves the region
        # explicitly: a value traced inside shard_map must not leak out.
        member_ids = {id(variable) for variable, _ in variables}
        state = [v for v in region.layer.variables if id(v) not in member_ids]
        out_axes = region.output_axes(args, kwargs)
        out_specs = jax.tree_util.tree_map(
            spec, out_axes, is_leaf=lambda x: x is None or isinstance(x, int)
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
