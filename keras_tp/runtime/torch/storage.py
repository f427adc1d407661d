"""A rank's storage of a Keras torch variable: its Parameter, swapped.

A split variable keeps its `torch.nn.Parameter` object, which Keras layers
and torch modules track, but the tensor inside is swapped for this rank's
slice, and the variable reports the local shape.
"""

import gc

import ml_dtypes
import numpy as np
import torch

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
    torch.distributed.broadcast(saved, src=0)
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
