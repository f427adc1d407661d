"""PyTorch runtime: one process per rank over `torch.distributed`.

Each rank is a process (started by `keras_tp.launch` or `torchrun`) in a
process group, gloo on CPU and nccl on GPU. A split Keras variable keeps
its `torch.nn.Parameter` but the parameter's storage is replaced by this
rank's slice, so the variable's shape is the local shape, Keras' optimizer
creates local slots from it, and Keras' own torch trainer runs unchanged.
A sharded region runs eagerly on the local tensors of the process.

`TorchRuntime` is put together from one mixin per part, with the same file
names as the other backends' runtimes:

- `devices`: how a process joins its rank's process group, and the
  groups of the mesh's axes;
- `storage`: a variable's Parameter, swapped for the rank's slice; full
  values, checkpoint pieces and the bytes on the rank's device;
- `steps`: Keras' steps on the rank's slice of the batch;
- `regions`: sharded layers on the rank's local tensors.

Besides them, `liveness` finds which rank was lost when a collective
fails, `saved_tensors` what a step keeps for its backward pass, and
`sequence` sequence parallelism's shards between the regions.

Multi-node runs use the usual torchrun flags, on every node:

```
torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK \
    --rdzv-backend c10d --rdzv-endpoint $HOST:29500 train.py
```
"""

import torch.distributed as dist

from keras_tp.collectives.base import set_process_adapter
from keras_tp.keras_internals import draw_from_state
from keras_tp.keras_internals import seed_generators
from keras_tp.runtime.mesh import MeshRuntime
from keras_tp.runtime.torch.devices import ProcessDevices
from keras_tp.runtime.torch.devices import configure_virtual_devices
from keras_tp.runtime.torch.devices import join_process_group
from keras_tp.runtime.torch.devices import join_ranks
from keras_tp.runtime.torch.devices import this_device
from keras_tp.runtime.torch.regions import ProcessRegions
from keras_tp.runtime.torch.sequence import SequenceShards
from keras_tp.runtime.torch.steps import ProcessSteps
from keras_tp.runtime.torch.storage import ProcessStorage
from keras_tp.runtime.torch.storage import parameter_of

__all__ = [
    "RUNTIME",
    "TorchRuntime",
    "configure_virtual_devices",
    "join_process_group",
]


class TorchRuntime(
    ProcessDevices, ProcessStorage, ProcessSteps, ProcessRegions, MeshRuntime
):
    """Runs tensor parallelism with one process per rank.

    The devices are named `"<type>:<rank>"`, one per rank of the process
    group (`"cpu:0"`, `"cpu:1"`, ... or `"cuda:0"`, ...), and each process
    stores and computes only its own rank's shards.
    """

    backend = "torch"
    stores_blocks = True
    # The sequence shards between the regions, under sequence parallelism.
    _sequence = None

    def __init__(self, config):
        """Arguments as `Runtime`'s; this process joins the group first."""
        ranks = join_ranks(config.world_size)
        super().__init__(config)
        set_process_adapter(self.adapter)
        if self.world_size != ranks:
            raise ValueError(
                f"device_ids name {self.world_size} device(s) but the process "
                f"group has {ranks} rank(s): on torch each rank is one process "
                "with one device."
            )
        if self.sequence_parallel:
            self._sequence = SequenceShards(
                self.adapter.inner, self._regions, self.placement.data_axes
            )

    def _build(self):
        self._input_widths = {}
        self._regions = []
        self.rank = dist.get_rank()
        self.device = this_device()

    def prepare_model(self, model):
        # Masks then come from the layers' seed generators, which every
        # rank holds alike and checkpoints save.
        draw_from_state(seed_generators(model))
        if self._sequence is not None:
            self._sequence.make_gradients_whole(
                parameter_of(v) for v in model.trainable_variables
            )


RUNTIME = TorchRuntime
