"""One collective interface for every backend.

Inside a sharded region (the call of a layer split by
`TensorParallelKeras`) or a launched process, these functions run on the
local tensor of the current rank over the `model` axis:

```python
from keras_tp import collectives
total = collectives.all_reduce(x, op="sum")
```

The conjugate operators are Megatron's `f` and `g` and their gather /
scatter twins; their gradients are exact (never N times too large).
"""

from keras_tp.collectives.base import REDUCE_OPS
from keras_tp.collectives.base import CollectiveAdapter
from keras_tp.collectives.base import current_adapter


def all_reduce(x, op="sum"):
    """Reduces `x` over the ranks with `op` (`sum`, `mean`, `max`, `min`)."""
    return current_adapter().all_reduce(x, op)


def all_gather(x, axis=0):
    """Concatenates every rank's `x` along `axis`."""
    return current_adapter().all_gather(x, axis)


def reduce_scatter(x, axis=0, op="sum"):
    """Sums `x` over ranks and returns this rank's slice along `axis`."""
    return current_adapter().reduce_scatter(x, axis, op)


def broadcast(x, root=0):
    """Returns rank `root`'s `x` on every rank."""
    return current_adapter().broadcast(x, root)


def barrier():
    """Waits until every rank gets here."""
    return current_adapter().barrier()


def rank():
    """This rank's index along the `model` axis."""
    return current_adapter().rank()


def size():
    """The number of ranks along the `model` axis."""
    return current_adapter().size()


def copy_to_parallel(x):
    """Identity forward; all-reduce of the gradient backward (Megatron f)."""
    return current_adapter().copy_to_parallel(x)


def reduce_from_parallel(x):
    """All-reduce forward; identity gradient backward (Megatron g)."""
    return current_adapter().reduce_from_parallel(x)


def gather_from_parallel(x, axis=-1):
    """All-gather along `axis` forward; local slice of the gradient back."""
    return current_adapter().gather_from_parallel(x, axis)


def scatter_to_parallel(x, axis=-1):
    """Local slice along `axis` forward; all-gather of the gradient back."""
    return current_adapter().scatter_to_parallel(x, axis)


__all__ = [
    "REDUCE_OPS",
    "CollectiveAdapter",
    "all_gather",
    "all_reduce",
    "barrier",
    "broadcast",
    "copy_to_parallel",
    "current_adapter",
    "gather_from_parallel",
    "rank",
    "reduce_from_parallel",
    "reduce_scatter",
    "scatter_to_parallel",
    "size",
]
