"""DDP and ZeRO in the optimizer: partitions, buckets and their collectives.

- stage 0 (DDP): the gradients are averaged with one all-reduce per bucket;
- stage 1: each rank keeps the full local gradient, reduce-scatters it, and
  updates only its partition of the optimizer state; the updated parameter
  partitions are all-gathered;
- stage 2: as stage 1, but only the gradient partition is kept;
- stage 3: parameters are partitioned too; the runtime gathers a layer's
  parameters around its call (`zero3.py`), and the gather's backward pass
  reduce-scatters the gradient, so the optimizer receives partitions.

A variable is partitioned along the first axis of its tensor-parallel shard
that the data-parallel size divides; a variable with no such axis stays
whole on every rank, and its gradient is all-reduced as under DDP.
"""

from keras_tp.keras_internals import bind_values
from keras_tp.parallel.buckets import PLAIN
from keras_tp.parallel.buckets import make_buckets
from keras_tp.parallel.buckets import partition


class ZeroLayout:
    """How a `CoordinatedOptimizer`'s variables lie over the `data` axis.

    Args:
        placement: the `Placement` of the variables.
        variables: the trainable variables, in the optimizer's order.
        zero_stage: 0 (DDP: nothing partitioned), 1, 2 or 3.
        cap_bytes: the most bytes of one collective call.

    Attributes:
        partition_axes: `{id(variable): its ZeRO partition axis, or None}`.
        buckets: the `Bucket`s the gradients travel in, in the order they
            are synchronised.
    """

    def __init__(self, placement, variables, zero_stage, cap_bytes):
        self.zero_stage = zero_stage
        self.partition_axes = {
            id(v): (placement.partition_axis(v) if zero_stage else None)
            for v in variables
        }
        self.buckets = make_buckets(
            variables,
            self.partition_axes,
            placement.model_shard_shape,
            cap_bytes,
        )

    def synchronised(self, grads, variables, adapter, codec=PLAIN):
        """The gradients every rank uses, each of its own partition.

        Buckets of whole variables are all-reduced; partitioned ones are
        reduce-scattered, except under ZeRO-3, whose partitioned gradients
        arrive reduced already.

        Args:
            grads: this rank's gradients of `variables`.
            variables: the trainable variables.
            adapter: the collective adapter of the `data` axis.
            codec: how the buckets travel (see `buckets.PlainCodec`; by
                default as they are).
        """
        out = list(grads)
        for bucket in self.buckets:
            if not bucket.partitioned:
                bucket.all_reduce(grads, variables, out, adapter, codec)
            elif self.zero_stage != 3:
                bucket.reduce_scatter(grads, variables, out, adapter, codec)
        return out

    def update(self, optimizer, grads, variables, adapter):
        """Applies `grads` with `optimizer` (`on_partitions`).

        Args:
            optimizer: the inner Keras optimizer.
            grads: the synchronised gradients, one per variable.
            variables: the trainable variables.
            adapter: the collective adapter of the `data` axis.
        """
        self.on_partitions(
            lambda: optimizer.apply(grads, variables), variables, adapter
        )

    def on_partitions(self, update, variables, adapter, gathers=True):
        """Runs `update`, which writes `variables` and their optimizer
        state: on the whole variables (DDP, ZeRO-3's partitions), or on
        this rank's partitions, all-gathered after where `gathers`.

        Under ZeRO-1 and 2 each partitioned variable is bound to this
        rank's partition while `update` runs, so that only the partition
        and its slots update; the updated partitions are then all-gathered,
        one call per bucket.
        """
        if self.zero_stage in (0, 3):
            update()
            return
        rank = adapter.rank()
        parts = adapter.size()
        axes = [self.partition_axes[id(v)] for v in variables]
        bound = [
            (variable, partition(variable.value, axis, rank, parts))
            for variable, axis in zip(variables, axes)
            if axis is not None
        ]
        with bind_values(bound) as scope:
            update()
            partitions = [
                None if axis is None else scope.get_current_value(variable)
                for variable, axis in zip(variables, axes)
            ]
        if not gathers:
            return
        for i, full in self.gathered(partitions, variables, adapter).items():
            variables[i].assign(full)

    def gathered(self, partitions, variables, adapter):
        """The partitioned variables' full values from each rank's
        partition, one all-gather per bucket.

        Args:
            partitions: per variable, this rank's partition (or anything,
                for a variable left whole).
            variables: the trainable variables.
            adapter: the collective adapter of the `data` axis.

        Returns:
            `{index in variables: full value}` of the partitioned ones.
        """
        whole = {}
        for bucket in self.buckets:
            if bucket.partitioned:
                bucket.all_gather(partitions, variables, whole, adapter)
        return whole

    def describe(self, variables):
        """The buckets' collective calls and the variables left whole.

        Returns:
            `{"buckets": [one entry per call], "unpartitioned_variables":
            [paths]}` (no paths under DDP, which partitions nothing).
        """
        return {
            "buckets": [
                entry for bucket in self.buckets for entry in bucket.describe()
            ],
            "unpartitioned_variables": [
                v.path
                for v in variables
                if self.zero_stage and self.partition_axes[id(v)] is None
            ],
        }
