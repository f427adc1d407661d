"""The sequence-parallel part of the PyTorch adapter: shards as `DTensor`s.

Under sequence parallelism a sequence shard is a `DTensor` split over the
adapter's ranks, so that the code between the split layers sees the whole
sequence's shape, and torch runs that code with collectives of its own.
`TorchSequenceCollectives` gives `TorchCollectiveAdapter` what this needs:
the adapter's ranks as a `DeviceMesh`, replicated weights whose gradients
are made whole, a `DTensor` gradient made whole, a shard gathered again in
the backward pass, and the counting of the collectives torch issues itself
(`count_functional`). It is a mixin of its own, apart from the adapter's
conjugate operators in `keras_tp.collectives.torch`, which import it.
"""

import functools

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Partial
from torch.distributed.tensor import Replicate
from torch.distributed.tensor import Shard

# What `count_functional` counts each functional collective as.
_FUNCTIONAL_KINDS = {
    "all_gather_into_tensor": "all_gather",
    "all_reduce": "all_reduce",
    "reduce_scatter_tensor": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "broadcast": "broadcast",
}


class TorchSequenceCollectives:
    """The `DTensor` side of `TorchCollectiveAdapter` (a mixin).

    It uses the adapter's `group`, `size`, `gather`, `sum_in_place` and
    `_record`.
    """

    @functools.cached_property
    def device_mesh(self):
        """This adapter's ranks as a one-axis `DeviceMesh`."""
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        return DeviceMesh.from_group(
            self.group or dist.group.WORLD, device_type
        )

    def replicated(self, x):
        """`x` as a `DTensor` replicated over this adapter's ranks.

        Its gradient, which code on sequence shards leaves as partial sums
        (or shards), is made whole by one counted all-reduce (or
        all-gather) in the backward pass: Megatron's all-reduce of the
        gradients of its sequence-parallel weights.
        """
        return _Replicated.apply(x, self)

    def whole_gradient(self, grad):
        """The whole value of a `DTensor` gradient, as a local tensor."""
        (placement,) = grad.placements
        local = grad.to_local()
        if isinstance(placement, Partial):
            self._record("all_reduce", local, "backward")
            # A dense copy: torch.distributed writes into it in place.
            local = local.clone(memory_format=torch.contiguous_format)
            return self.sum_in_place(local)
        if isinstance(placement, Shard):
            self._record("all_gather", grad, "backward")
            return self._gather_uneven(local, placement.dim, grad.shape)
        return local

    def regather_sequence(self, shard):
        """A sequence shard (a `DTensor`) all-gathered again in the backward
        pass, for the gradients of the weights that read it whole: counted,
        and outside autograd."""
        (placement,) = shard.placements
        local = shard.to_local().detach()
        self._record("all_gather", local, "backward", self.size())
        return self.gather(local, placement.dim)

    def count_functional(self, op, x):
        """Counts a functional collective `op` (`"_c10d_functional::..."`)
        that torch issued itself on input `x`, in the forward or the
        backward pass."""
        name = op.split("::")[-1]
        if name not in _FUNCTIONAL_KINDS:
            # wait_tensor and the like move nothing.
            return
        kind = _FUNCTIONAL_KINDS[name]
        # An all-gather moves `size()` times its input.
        scale = self.size() if kind == "all_gather" else 1
        # Autograd's engine runs a graph task only in a backward pass.
        in_backward = torch._C._current_graph_task_id() >= 0
        direction = "backward" if in_backward else "forward"
        self._record(kind, x, direction, scale)
        self._enter(kind, x, direction)

    def _gather_uneven(self, local, axis, shape):
        # DTensor shards as `torch.chunk` does: the last ranks' shards may
        # be shorter, or empty.
        length = -(-shape[axis] // self.size())
        padding = [0, 0] * (local.ndim - axis - 1)
        padded = torch.nn.functional.pad(
            local, padding + [0, length - local.shape[axis]]
        )
        return self.gather(padded, axis).narrow(axis, 0, shape[axis])


class _Replicated(torch.autograd.Function):
    """A local tensor as a replicated `DTensor`; its gradient made whole."""

    @staticmethod
    def forward(ctx, x, adapter):
        ctx.adapter = adapter
        return DTensor.from_local(
            x, adapter.device_mesh, [Replicate()], run_check=False
        )

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor):
            grad = ctx.adapter.whole_gradient(grad)
        return grad, None
