"""Sharded regions on the mesh: a split layer's call as a `shard_map`.

Outside per-rank steps a region runs its per-rank math in a small
`jax.shard_map` over the `model` axis, on global arrays. Inside a per-rank
step (a data axis or ZeRO), which is one `shard_map` over both axes already,
it runs directly on the local values (`Runtime.run_local_region`).
"""

import contextlib
import contextvars
import functools

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec

from keras_tp.collectives.sequence import SEQUENCE_AXIS
from keras_tp.collectives.sequence import is_sequence
from keras_tp.collectives.sequence import region_inputs
from keras_tp.keras_internals import StatelessScope
from keras_tp.keras_internals import get_keras_mask
from keras_tp.keras_internals import set_keras_mask
from keras_tp.regions import shared_value
from keras_tp.tensors import is_float

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
    def tracing_per_rank(self):
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

    @functools.cached_property
    def _sequence_copies_per_device(self):
        return self.adapter.sequence_copies_per_device(self.mesh)

    @functools.cached_property
    def _copies_per_device(self):
        return self.adapter.copies_per_device(self.mesh)

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
        array_index = {}
        arrays = []
        for leaf in leaves:
            if is_array(leaf) and id(leaf) not in array_index:
                array_index[id(leaf)] = len(arrays)
                arrays.append(leaf)
        split = region.split_inputs(args, kwargs)
        array_specs = [spec(split.get(id(a))) for a in arrays]
        # Replicated float inputs of a region with split weights enter as
        # one copy per device, shared by every region that reads them in
        # this call, so their gradient is all-reduced once (Megatron `f`).
        per_device = [
            region.parallel_input and spec == PartitionSpec() and is_float(a)
            for a, spec in zip(arrays, array_specs)
        ]
        arrays = [
            shared_value(a, self._copies_of(region, a)) if copy else a
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
                region_inputs(region.main_input(local_args, local_kwargs)),
            ):
                outputs = region.compute(*local_args, **local_kwargs)
            return outputs, [scope.get_current_value(v) for v in state]

        in_specs = (
            array_specs,
            [PartitionSpec()] * len(mask_arrays),
            weight_specs,
            [PartitionSpec()] * len(state),
        )
        inputs = (arrays, mask_arrays, weights, [v.value for v in state])
        if self.sequence_parallel:
            out_specs = self._sequence_out_specs(
                local_fn, in_specs, inputs, out_specs
            )
        mapped = jax.shard_map(
            local_fn,
            mesh=self.mesh,
            in_specs=in_specs,
            out_specs=(out_specs, [PartitionSpec()] * len(state)),
            check_vma=True,
        )
        outputs, new_state = mapped(*inputs)
        for variable, value in zip(state, new_state):
            variable.assign(value)
        return outputs

    def split_on_model(self, value, axis):
        """Outside per-rank steps, a global array laid out split on `axis`
        over `model`, so each device holds its part (a constraint on a
        traced value)."""
        if self._inside_ranks:
            return super().split_on_model(value, axis)
        sharding = NamedSharding(self.mesh, spec(axis))
        if isinstance(value, jax.core.Tracer):
            return jax.lax.with_sharding_constraint(value, sharding)
        return jax.device_put(value, sharding)

    def run_split_function(self, function, args, split_axes, output_axis=None):
        if self._inside_ranks:
            return function(self.adapter, *args)
        adapter = self.adapter

        def local(*local_args):
            with adapter.activated():
                return function(adapter, *local_args)

        return jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=tuple(spec(axis) for axis in split_axes),
            out_specs=spec(output_axis),
            check_vma=True,
        )(*args)

    def _copies_of(self, region, array):
        """How a replicated input enters a region: as one copy per device
        (Megatron `f`), or under sequence parallelism a sequence
        activation as the all-gather of its sequence shards."""
        if not (self.sequence_parallel and is_sequence(array)):
            return self._copies_per_device
        length = array.shape[SEQUENCE_AXIS]
        if length % self.tensor_parallel:
            raise ValueError(
                f"sequence_parallel=True splits the input of layer "
                f"'{region.layer.path}', of shape {tuple(array.shape)}, on "
                f"its sequence axis ({SEQUENCE_AXIS}) over "
                f"{self.tensor_parallel} devices, so the sequence length "
                f"must divide by {self.tensor_parallel}. Pad the sequences "
                "to a multiple of it, or pass sequence_parallel=False."
            )
        return self._sequence_copies_per_device

    def _sequence_out_specs(self, local_fn, in_specs, inputs, out_specs):
        """A region's output specs, its reduce-scattered outputs split on
        the sequence.

        Which outputs the region's `reduce_from_parallel` reduce-scattered
        is known once its per-rank function is traced: an output meant to
        be replicated that varies over `model` is a sequence shard, the
        only one a region makes. The function is traced once more,
        abstractly and uncounted, to find out.

        Args:
            local_fn: the region's per-rank function.
            in_specs: its in-specs.
            inputs: its global inputs.
            out_specs: the specs of its outputs (a prefix of them).

        Returns:
            The specs of every output.
        """
        flags = []

        def probe(*args):
            outputs, _ = local_fn(*args)
            flags.extend(
                _varies_over_model(leaf)
                for leaf in jax.tree_util.tree_leaves(outputs)
            )
            # One row per device: valid whatever each output's split.
            return jax.tree_util.tree_map(lambda x: x[None], outputs)

        with self.adapter.stats.discarding():
            shapes = jax.eval_shape(
                jax.shard_map(
                    probe,
                    mesh=self.mesh,
                    in_specs=in_specs,
                    out_specs=PartitionSpec("model"),
                    check_vma=True,
                ),
                *inputs,
            )
        treedef = jax.tree_util.tree_structure(shapes)
        specs = _leaf_specs(out_specs, shapes)
        return jax.tree_util.tree_unflatten(
            treedef,
            [
                _SEQUENCE_SHARDS
                if varying and spec == PartitionSpec()
                else spec
                for spec, varying in zip(specs, flags)
            ],
        )


# A sequence activation split on its sequence axis over `model`.
_SEQUENCE_SHARDS = PartitionSpec(None, "model")


def _varies_over_model(value):
    """Whether a traced value inside a `shard_map` that checks varying
    manual axes may differ between the `model` devices (its type's
    manual axis type, which `jax.typeof` reports)."""
    return "model" in jax.typeof(value).mat.varying


def _leaf_specs(prefix, tree):
    """The spec of each leaf of `tree`, from a prefix tree of specs."""
    specs = []

    def expand(spec, subtree):
        specs.extend([spec] * len(jax.tree_util.tree_leaves(subtree)))

    jax.tree_util.tree_map(
        expand, prefix, tree, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )
    return specs
