"""A rank's storage of a Keras torch variable: its Parameter, swapped.

A split variable keeps its `torch.nn.Parameter` object, which Keras layers
and torch modules track, but the tensor inside is swapped for this rank's
slice, and the variable reports the local shape. Full values are gathered
over the mesh's axes; a checkpoint holds each rank's own piece.
"""

import gc

import keras
import ml_dtypes
import numpy as np
import torch
import torch.distributed as dist

from keras_tp.keras_internals import graph_constants
from keras_tp.keras_internals import set_reported_shape
from keras_tp.keras_internals import stored_value


def parameter_of(variable):
    """The `torch.nn.Parameter` a Keras torch variable stores its value in."""
    return stored_value(variable)


def to_numpy(tensor):
    """`tensor` on the host as NumPy; bfloat16 through ml_dtypes."""
    tensor = tensor.cpu()
    if tensor.dtype == torch.bfloat16:
        return tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def from_numpy(array):
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    # asarray, not ascontiguousarray, which makes scalars 1-D.
    return torch.from_numpy(np.asarray(array, order="C"))


def swap_storage(variable, value):
    """Makes `variable` hold `value` (any shape); returns the old Parameter.

    The `torch.nn.Parameter` object stays the one Keras layers and torch
    modules track, but its tensor is swapped whole: assigning `.data` would
    keep autograd metadata of the old shape, which breaks the next backward
    pass if a graph built before (the planner's trace, say) is alive.
    """
    parameter = parameter_of(variable)
    if not isinstance(value, torch.nn.Parameter):
        value = torch.nn.Parameter(value, requires_grad=parameter.requires_grad)
    try:
        torch.utils.swap_tensors(parameter, value)
    except RuntimeError:
        # A dead autograd graph in a reference cycle still holds the tensor.
        gc.collect()
        try:
            torch.utils.swap_tensors(parameter, value)
        except RuntimeError as e:
            raise RuntimeError(
                f"Cannot split variable '{variable.path}': a live autograd "
                "graph still uses it (an output of the model computed with "
                "gradients before wrapping it, say). Delete such outputs, or "
                "compute them under torch.no_grad(), before creating "
                f"TensorParallelKeras. ({e})"
            ) from None
    set_reported_shape(variable, parameter.shape)
    return value


def broadcast_from_rank_zero(variables):
    """Sets `variables` to rank 0's values on every rank of the process
    group, in place: one broadcast per variable, before it is split."""
    if dist.get_world_size() == 1:
        return
    for variable in variables:
        tensor = parameter_of(variable).data
        if tensor.dtype == torch.bool:
            tensor = tensor.view(torch.uint8)
        dist.broadcast(tensor, src=0)


def write_on_rank_zero(rank, full_values, write):
    """Runs `write` on rank 0 while its variables hold full values.

    Every rank returns once the file is written, and raises if rank 0
    failed to write it.

    Args:
        rank: this process's rank.
        full_values: `(variable, full tensor)` pairs, which every rank
            iterates (making them may take collectives); rank 0 holds
            each full tensor in its variable while it writes.
        write: the function that writes, run on rank 0.
    """
    held = []
    error = None
    try:
        for variable, full in full_values:
            if rank == 0:
                held.append((variable, swap_storage(variable, full)))
        if rank == 0:
            write()
    except Exception as e:
        error = e
    finally:
        for variable, own in held:
            swap_storage(variable, own)
    saved = torch.tensor([error is None], dtype=torch.int32)
    dist.broadcast(saved, src=0)
    if error is not None:
        raise error
    if not saved.item():
        raise RuntimeError(
            "Rank 0 failed to write the model's weights; its exception "
            "says why."
        )


def storage_bytes(variables):
    """The bytes of the torch storages behind `variables`, each once."""
    seen = set()
    total = 0
    for variable in variables:
        storage = parameter_of(variable).untyped_storage()
        key = (storage.device, storage.data_ptr())
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


class RankProcess:
    """Runtime mixin: this process is rank `self.rank` of the torch job's
    process group (`TorchRuntime`, and `TorchPipelineRuntime` too)."""

    def weights_held_by_graph(self, model):
        """As `Runtime`'s: the parameters a graph constant views, or that
        its autograd graph reads (keras-hub's Gemma3n keeps the transpose
        of its embedding, taken when it was built, for its logits)."""
        variables = {id(parameter_of(v)): v for v in model.variables}
        held = {}
        for name, constant in graph_constants(model):
            for tensor in _tensors_read(constant):
                variable = variables.get(id(tensor))
                if variable is not None:
                    held.setdefault(id(variable), name)
        return held

    def process_index(self):
        return self.rank

    def wait_for_processes(self):
        dist.barrier()

    def gather_objects(self, value):
        values = [None] * dist.get_world_size()
        dist.all_gather_object(values, value)
        return values

    def equalize_values(self, variables):
        broadcast_from_rank_zero(variables)


class ProcessStorage(RankProcess):
    """The `TorchRuntime`'s variables, each holding this rank's part."""

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

    def unsplit(self, variable, tensor):
        """Gathers `tensor`, a rank's part of `variable`, over both axes."""
        data_axis = self.placement.data_axis(variable)
        if data_axis is not None:
            tensor = self.data_adapter.gather(tensor, data_axis)
        axis = self.placement.axes[id(variable)]
        if axis is not None:
            tensor = self.adapter.gather(tensor, axis)
        return tensor

    def full_value(self, variable):
        value = self.unsplit(variable, parameter_of(variable).detach())
        value = keras.ops.convert_to_numpy(value)
        return self.placement.canonical(variable, value)

    def assign_full_value(self, variable, value):
        """Assigns this rank's part of `value`.

        Every rank passes the same full `value`, as in any SPMD program, so
        each takes its part locally without communicating.
        """
        tensor = keras.ops.convert_to_tensor(value, dtype=variable.dtype)
        tensor = self.placement.stored(variable, tensor)
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
            ((v, self._unsplit_canonical(v)) for v in split),
            write,
        )

    def _unsplit_canonical(self, variable):
        """The full value of `variable`, a tensor in its layer's layout."""
        full = self.unsplit(variable, parameter_of(variable).detach())
        return self.placement.canonical(variable, full)

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

    def device_bytes(self, variables):
        """`{this rank's device: bytes}`, each torch storage counted once."""
        return {self.devices[self.rank]: storage_bytes(variables)}


def _tensors_read(tensor):
    """The tensor `tensor` views, and the leaves its autograd graph reads."""
    read = [tensor._base] if tensor._base is not None else []
    functions, seen = [tensor.grad_fn], set()
    while functions:
        function = functions.pop()
        if function is None or function in seen:
            continue
        seen.add(function)
        # An `AccumulateGrad` node holds the leaf it accumulates into.
        if hasattr(function, "variable"):
            read.append(function.variable)
        functions += [after for after, _ in function.next_functions]
    return read
