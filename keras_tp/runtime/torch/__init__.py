"""PyTorch runtime: one process per rank over `torch.distributed`.

Each rank is a process (started by `keras_tp.launch` or `torchrun`) in a
process group, gloo on CPU and nccl on GPU. A split Keras variable keeps
its `torch.nn.Parameter` but the parameter's storage is replaced by this
rank's slice, so the variable's shape is the local shape, Keras' optimizer
creates local slots from it, and Keras' own torch trainer runs unchanged.
A sharded region runs eagerly on the local tensors of the process.

- `process_group`: how a process joins its rank's process group;
- `storage`: a variable's Parameter, swapped for the rank's slice;
- `liveness`: which rank was lost when a collective fails;
- `saved_tensors`: what a step keeps for its backward pass;
- `sequence`: sequence parallelism's shards between the regions.

Multi-node runs use the usual torchrun flags, on every node:

```
torchrun --nnodes 2 --nproc-per-node 8 --node-rank $NODE_RANK \
    --rdzv-backend c10d --rdzv-endpoint $HOST:29500 train.py
```
"""

import contextlib
import os
import socket

import keras
import numpy as np
import torch
import torch.distributed as dist

from keras_tp.collectives.base import set_process_adapter
from keras_tp.collectives.torch import TorchCollectiveAdapter
from keras_tp.collectives.torch import is_symbolic
from keras_tp.keras_internals import draw_from_state
from keras_tp.keras_internals import seed_generators
from keras_tp.parallel import CoordinatedOptimizer
from keras_tp.parallel.overlap import BackwardOverlap
from keras_tp.runtime.base import median_seconds
from keras_tp.runtime.mesh import MeshRuntime
from keras_tp.runtime.torch.process_group import configure_virtual_devices
from keras_tp.runtime.torch.process_group import join_process_group
from keras_tp.runtime.torch.process_group import mesh_groups
from keras_tp.runtime.torch.process_group import rank_devices
from keras_tp.runtime.torch.process_group import this_device
from keras_tp.runtime.torch.saved_tensors import DetachedSavedTensors
from keras_tp.runtime.torch.sequence import SequenceShards
from keras_tp.runtime.torch.storage import from_numpy
from keras_tp.runtime.torch.storage import parameter_of
from keras_tp.runtime.torch.storage import storage_bytes
from keras_tp.runtime.torch.storage import swap_storage
from keras_tp.runtime.torch.storage import to_numpy
from keras_tp.runtime.torch.storage import write_on_rank_zero

__all__ = [
    "RUNTIME",
    "TorchRuntime",
    "configure_virtual_devices",
    "join_process_group",
]


class TorchRuntime(MeshRuntime):
    """Runs tensor parallelism with one process per rank.

    The devices are named `"<type>:<rank>"`, one per rank of the process
    group (`"cpu:0"`, `"cpu:1"`, ... or `"cuda:0"`, ...), and each process
    stores and computes only its own rank's shards.
    """

    backend = "torch"
    # The sequence shards between the regions, under sequence parallelism.
    _sequence = None

    def __init__(self, config):
        """Arguments as `Runtime`'s; this process joins the group first."""
        world_size = config.world_size
        join_process_group(world_size)
        ranks = dist.get_world_size()
        if world_size is not None and world_size != ranks:
            raise ValueError(
                f"world_size={world_size} but this process group has {ranks} "
                f"rank(s). Start {world_size} processes (keras_tp.launch or "
                f"torchrun --nproc-per-node {world_size}) or pass "
                f"world_size={ranks}."
            )
        super().__init__(config)
        set_process_adapter(self.adapter)
        if self.world_size != ranks:
            raise ValueError(
                f"device_ids name {self.world_size} device(s) but the process "
                f"group has {ranks} rank(s): on torch each rank is one process "
                "with one device."
            )
        if self.sequence_parallel:
            self._sequence = SequenceShards(self.adapter.inner, self._regions)

    def _available_devices(self):
        return rank_devices()

    def _build(self):
        self._input_widths = {}
        self._regions = []
        self.rank = dist.get_rank()
        self.device = this_device()

    def _axis_adapters(self):
        model_group, data_group, mesh_group = self._axis_groups()
        return (
            TorchCollectiveAdapter(model_group),
            TorchCollectiveAdapter(data_group, "data"),
            TorchCollectiveAdapter(mesh_group, ("data", "model")),
        )

    def _axis_groups(self):
        """This rank's process groups of the `model` axis, the `data` axis
        and the whole `data x model` mesh.

        Rank `r` sits at row `r // tensor_parallel` and column
        `r % tensor_parallel` of the mesh; a group of every rank is the
        default group (`None`).
        """
        model_group, data_group = mesh_groups(
            {"data": self.data_parallel, "model": self.tensor_parallel},
            "model",
            "data",
        )
        return model_group, data_group, None

    def time_data_all_reduce(self, nbytes, repeats):
        buffer = torch.zeros(nbytes // 4, device=self.device)
        group = self.data_adapter.group

        def all_reduce():
            dist.all_reduce(buffer, group=group)
            if buffer.is_cuda:
                torch.cuda.synchronize(buffer.device)

        seconds = median_seconds(all_reduce, repeats)
        # Every rank takes the slowest rank's time, so all choose alike.
        slowest = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return float(slowest)

    def _rank_hosts(self):
        # torchrun numbers the nodes GROUP_RANK; a job set up by hand is
        # told apart by host name.
        host = os.environ.get("GROUP_RANK") or socket.gethostname()
        hosts = [None] * self.world_size
        dist.all_gather_object(hosts, host)
        return hosts

    def _level_adapters(self, within, across):
        model = self.tensor_parallel

        def adapter(groups):
            # Data rank d of shard m is global rank d * model + m; every
            # rank creates every group, as torch.distributed requires.
            enumeration = [
                [d * model + m for d in ranks]
                for m in range(model)
                for ranks in groups
            ]
            group, _ = dist.new_subgroups_by_enumeration(enumeration)
            return TorchCollectiveAdapter(group, "data")

        return adapter(within), adapter(across)

    def place_variable(self, variable, axis):
        value = parameter_of(variable).detach()
        if axis is not None:
            value = self.adapter.local_slice(value, axis)
        elif value.device == self.device:
            return
        swap_storage(variable, value.to(self.device))

    def place_variable_like(self, variable, reference, data_axis):
        """Keeps this rank's data partition of a slot made like `reference`.

        Keras made the slot in the reference's local shape: its
        tensor-parallel shard, already partitioned if the reference is
        (ZeRO-3), in which case there is nothing left to cut.
        """
        if (
            data_axis is not None
            and id(reference) not in self.placement.data_axes
        ):
            self.partition_variable(variable, data_axis)

    def partition_variable(self, variable, data_axis):
        value = parameter_of(variable).detach()
        swap_storage(variable, self.data_adapter.local_slice(value, data_axis))

    def _unsplit(self, variable, tensor):
        """Gathers `tensor`, a rank's part of `variable`, over both axes."""
        data_axis = self.placement.data_axis(variable)
        if data_axis is not None:
            tensor = self.data_adapter.gather(tensor, data_axis)
        axis = self.placement.axes[id(variable)]
        if axis is not None:
            tensor = self.adapter.gather(tensor, axis)
        return tensor

    def full_value(self, variable):
        value = self._unsplit(variable, parameter_of(variable).detach())
        return keras.ops.convert_to_numpy(value)

    def assign_full_value(self, variable, value):
        """Assigns this rank's part of `value`.

        Every rank passes the same full `value`, as in any SPMD program, so
        each takes its part locally without communicating.
        """
        tensor = keras.ops.convert_to_tensor(value, dtype=variable.dtype)
        axis = self.placement.axes[id(variable)]
        if axis is not None:
            tensor = self.adapter.local_slice(tensor, axis)
        data_axis = self.placement.data_axis(variable)
        if data_axis is not None:
            tensor = self.data_adapter.local_slice(tensor, data_axis)
        variable.assign(tensor)

    def _write_unsplit(self, model, variables, write):
        """Runs `write` on rank 0 while its variables hold full values.

        The other ranks hold one full variable at a time while gathering.
        Every rank returns once the file is written, and raises if rank 0
        failed to write it.
        """
        split = [
            variable
            for variable in variables
            if self.placement.local_shape(variable)
            != self.placement.full_shapes[id(variable)]
        ]
        write_on_rank_zero(
            self.rank,
            ((v, self._unsplit(v, parameter_of(v).detach())) for v in split),
            write,
        )

    def replica_differences(self, variables):
        """Largest difference between the copies of each variable.

        A rank's copy is compared with those of the ranks that must hold
        the same numbers: its data-parallel replicas (unless the variable
        is partitioned over `data`) and, for a replicated variable, the
        other model ranks. Every rank returns the same, world-wide result.
        """
        worst = []
        for variable in variables:
            local = parameter_of(variable).detach().double()
            difference = local.new_zeros(())
            peers = []
            if id(variable) not in self.placement.data_axes:
                peers.append(self.data_adapter)
            if self.placement.split_axis(variable) is None:
                peers.append(self.adapter)
            for adapter in peers:
                copies = adapter.gather(local.unsqueeze(0), 0)
                difference = torch.maximum(
                    difference, (copies - local).abs().max()
                )
            worst.append(difference)
        if not worst:
            return {}
        worst = torch.stack(worst)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        return {
            variable.path: float(difference)
            for variable, difference in zip(variables, worst)
        }

    def _ranks_here(self):
        model_rank = self.adapter.rank()
        return [(f"rank{self.rank}", model_rank, self.data_adapter.rank())]

    def _read_piece(self, variable, position):
        return to_numpy(parameter_of(variable).detach())

    def _write_piece(self, variable, position, value):
        parameter_of(variable).data.copy_(from_numpy(value))

    def process_index(self):
        return self.rank

    def wait_for_processes(self):
        dist.barrier()

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
        if is_symbolic(gathered[0]):
            # Keras infers shapes on "meta" tensors: nothing to free.
            yield gathered
            return
        storages = {
            t.untyped_storage().data_ptr(): i for i, t in enumerate(gathered)
        }

        def pack(tensor):
            index = storages.get(tensor.untyped_storage().data_ptr())
            if index is None:
                return tensor
            return (
                index,
                tensor.size(),
                tensor.stride(),
                tensor.storage_offset(),
            )

        def unpack(packed):
            if isinstance(packed, torch.Tensor):
                return packed
            index, size, stride, offset = packed
            partition = partitions[index].detach()
            adapter._record("all_gather", partition, "backward", adapter.size())
            full = adapter.gather(partition, axes[index])
            return full.as_strided(size, stride, offset)

        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield gathered

    def device_bytes(self, variables):
        """`{this rank's device: bytes}`, each torch storage counted once."""
        return {self.devices[self.rank]: storage_bytes(variables)}

    def run_step(self, phase, step, *args, **kwargs):
        """Runs Keras' step; with a data axis, on this rank's batch slice.

        Each data rank trains on its slice of the global batch. Its metric
        updates are summed over `data` and its float non-trainable state
        averaged (one all-reduce), so the logs are the global batch's; the
        predictions of the slices are gathered into the global batch's.
        """
        if not self.per_rank_steps:
            with self._step_context():
                return super().run_step(phase, step, *args, **kwargs)
        (data,) = args
        model = step.__self__
        with self.adapter.stats.recording(phase), self._step_context():
            data = keras.tree.map_structure(self.batch_slice, data)
            if phase == "predict":
                return keras.tree.map_structure(
                    lambda y: (
                        self.data_adapter.all_gather(y, 0)
                        if torch.is_tensor(y)
                        else y
                    ),
                    step(data),
                )
            metrics = model.metrics_variables
            before = [v.value.detach().clone() for v in metrics]
            if phase == "train":
                self._start_backward_overlap(model)
            step(data)
            non_trainable = model.non_trainable_variables
            new_metrics, values = self.synchronised_state(
                non_trainable,
                [v.value.detach() for v in non_trainable],
                before,
                [v.value.detach() for v in metrics],
            )
            for variable, value in zip(
                metrics + non_trainable, new_metrics + values
            ):
                variable.assign(value)
            return model.get_metrics_result()

    def run_on_ranks(self, fn, variables, phase):
        """Runs `fn()` in this rank's process, without autograd, as Keras'
        torch trainer runs the optimizer."""
        with torch.no_grad():
            super().run_on_ranks(fn, variables, phase)

    def _start_backward_overlap(self, model):
        """Sends each gradient bucket as soon as the backward pass made it.

        Each trainable parameter gets a post-accumulate-grad hook (once,
        when the optimizer is built) that hands its gradient to the
        optimizer's `BackwardOverlap`; a bucket complete starts its
        all-reduce asynchronously, while the backward pass goes on.
        """
        optimizer = getattr(model, "optimizer", None)
        if not (
            isinstance(optimizer, CoordinatedOptimizer)
            and optimizer.built
            and optimizer.overlaps
        ):
            return
        if optimizer.backward_overlap is None:
            variables = list(model.trainable_variables)
            overlap = BackwardOverlap(
                optimizer.buckets, variables, self.data_adapter
            )
            for index, variable in enumerate(variables):
                parameter_of(variable).register_post_accumulate_grad_hook(
                    lambda parameter, index=index: overlap.gradient_ready(
                        index, parameter.grad
                    )
                )
            optimizer.backward_overlap = overlap
        optimizer.backward_overlap.start_step()

    def batch_slice(self, tensor):
        """This data rank's slice of a global batch tensor."""
        if isinstance(tensor, np.ndarray):
            # `train_on_batch` and the like hand NumPy batches over as
            # they are; `fit()` hands tensors.
            tensor = keras.ops.convert_to_tensor(tensor)
        if not torch.is_tensor(tensor) or tensor.ndim == 0:
            return tensor
        self.check_batch_size(tensor.shape[0])
        size = tensor.shape[0] // self.data_parallel
        return tensor.narrow(0, self.data_adapter.rank() * size, size)

    def call_model(self, model, inputs, training):
        if self._sequence is None:
            return super().call_model(model, inputs, training)
        with self._sequence.step():
            outputs = super().call_model(model, inputs, training)
            return self._sequence.whole(outputs)

    def _step_context(self):
        """A step keeps its saved tensors detached (see `saved_tensors`);
        under sequence parallelism, in the shards' context, which does
        too."""
        if self._sequence is None:
            return DetachedSavedTensors()
        return self._sequence.step()

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

    def prepare_model(self, model):
        # Masks then come from the layers' seed generators, which every
        # rank holds alike and checkpoints save.
        draw_from_state(seed_generators(model))
        if self._sequence is not None:
            self._sequence.make_gradients_whole(
                parameter_of(v) for v in model.trainable_variables
            )

    def prepare_region(self, region):
        """Lets the region's layers take local-width inputs.

        A Row layer here receives a Column layer's local output, and Keras
        checks a layer's `input_spec` before its `call`; `run_region`
        checks the widths instead, split-aware (`check_input_widths`).
        """
        self._input_widths[id(region)] = region.drop_input_widths()
        self._regions.append(region)


RUNTIME = TorchRuntime
