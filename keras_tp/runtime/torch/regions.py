"""How a sharded region runs on a torch rank: eagerly, on local tensors.

A region's layers hold this rank's shards and run in its process; the
Megatron `f`/`g` functions of the collectives adapter communicate with the
other model ranks. Under ZeRO-3 a region gathers its parameters'
partitions for the call and again for the backward pass; under sequence
parallelism its inputs enter from the sequence shards (`sequence`).
"""

import collections
import contextlib

import torch
from torch.distributed.tensor import DTensor

from keras_tp.collectives.torch import is_symbolic


class ProcessRegions:
    """The `TorchRuntime`'s regions (see the module)."""

    def prepare_region(self, region):
        """Lets the region's layers take local-width inputs.

        A Row layer here receives a Column layer's local output, and Keras
        checks a layer's `input_spec` before its `call`; `run_region`
        checks the widths instead, split-aware (`check_input_widths`).
        """
        self._input_widths[id(region)] = region.drop_input_widths()
        self._regions.append(region)

    def run_region(self, region, args, kwargs):
        region.check_input_widths(
            self._input_widths[id(region)], args, self.tensor_parallel
        )
        if self._sequence is None:
            return self.run_local_region(region, args, kwargs)
        if not region.parallel_input:
            args, kwargs = self._sequence.whole((args, kwargs))
        return self.run_local_region(
            region, args, kwargs, enter=self._sequence.enter
        )

    @contextlib.contextmanager
    def _gathered_partitions(self, layer, variables, axes):
        """Gathers the partitions for the call, and again for its backward.

        The gathered parameters live only while the layer runs: autograd
        keeps the partition in their place and gathers them again when the
        backward pass needs them, so a step communicates each parameter
        three times (gather, re-gather, reduce-scatter of its gradient).
        """
        adapter = self.data_adapter
        partitions = [v.value for v in variables]
        gathered = [
            adapter.gather_partitions(p, axis)
            for p, axis in zip(partitions, axes)
        ]
        # What the layer reads: a layer between the regions called on a
        # sequence shard, replicated DTensors (a region reads its inputs
        # whole, and its weights as they are).
        read = gathered
        regions = {id(region.layer) for region in self._regions}
        if self._sequence is not None and id(layer) not in regions:
            read = self._sequence.replicated_if_on_shards(gathered)
        if is_symbolic(gathered[0]):
            # Keras infers shapes on "meta" tensors: nothing to free.
            yield read
            return
        storages = {
            t.untyped_storage().data_ptr(): i for i, t in enumerate(gathered)
        }

        # The step's own hooks (a sequence shard's regather) take what
        # these do not: the innermost hooks alone see the saved tensors.
        outer = None if self._sequence is None else self._sequence.saved

        def pack(tensor):
            # A replicated DTensor (a norm's weight on a sequence shard)
            # is not packed: a whole layer's weights are small.
            index = None
            if not isinstance(tensor, DTensor):
                index = storages.get(tensor.untyped_storage().data_ptr())
            if index is None:
                return tensor if outer is None else outer.pack(tensor)
            return _SavedPartition(
                index, tensor.size(), tensor.stride(), tensor.storage_offset()
            )

        def unpack(packed):
            if not isinstance(packed, _SavedPartition):
                return packed if outer is None else outer.unpack(packed)
            index, size, stride, offset = packed
            partition = partitions[index].detach()
            adapter._record("all_gather", partition, "backward", adapter.size())
            full = adapter.gather(partition, axes[index])
            return full.as_strided(size, stride, offset)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield read


# A gathered partition saved for the backward pass: gathered again there.
_SavedPartition = collections.namedtuple(
    "_SavedPartition", "index size stride offset"
)
