"""PyTorch adapter: `torch.distributed` collectives between rank processes.

Every rank is a process holding its local tensors, so the collectives are
the `torch.distributed` ones over a process group (gloo on CPU, nccl on
GPU). Plain `dist.all_reduce` is invisible to autograd, and the gradient of
`torch.distributed.nn.functional.all_reduce` is another all-reduce, which
makes tensor-parallel gradients N times too large. So Megatron's conjugate
operators are small `torch.autograd.Function`s whose backward pass issues
(and counts) exactly the collective the math needs, or none.

Under sequence parallelism a sequence shard is a `DTensor` split over the
adapter's ranks (`reduce_scatter_sequence` makes one), so that the code
between the split layers sees the whole sequence's shape; a gradient that
comes back as a `DTensor` is made whole by a counted collective
(`whole_gradient`). Those `DTensor` methods are a mixin of their own
(`keras_tp.collectives.torch_sequence`).
"""

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor import Shard

from keras_tp.collectives.base import CollectiveAdapter
from keras_tp.collectives.torch_sequence import TorchSequenceCollectives

_TORCH_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM,
    # gloo has no AVG: "mean" is a sum divided by the number of ranks.
    "mean": dist.ReduceOp.SUM,
    "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN,
}


def is_symbolic(x):
    """Whether `x` only carries a shape (Keras traces on the meta device).

    Keras infers output shapes by running layers on "meta" tensors, which
    have no data. Every rank traces alike, so a collective there is skipped
    and only its output shape is produced.
    """
    return x.device.type == "meta"


class TorchCollectiveAdapter(TorchSequenceCollectives, CollectiveAdapter):
    """Collectives over a `torch.distributed` process group.

    Valid in every process of an initialised process group (started by
    `keras_tp.launch` or `torchrun`); the adapter may be created before the
    group is. The raw collectives (`all_reduce`, `all_gather`,
    `reduce_scatter`, `broadcast`) move data without gradients;
    differentiable code uses the conjugate operators.

    Args:
        group: the `torch.distributed` process group of the `model` axis;
            `None` is the default (world) group.
        axis_name: name of the mesh axis the collectives run over.

    Example:

    ```python
    adapter = TorchCollectiveAdapter()
    total = adapter.all_reduce(torch.ones(3))   # 3 x world_size
    ```
    """

    backend = "torch"

    def __init__(self, group=None, axis_name="model"):
        super().__init__(axis_name)
        self.group = group

    def rank(self):
        return dist.get_rank(self.group)

    def size(self):
        return dist.get_world_size(self.group)

    def barrier(self):
        self._enter("barrier", torch.empty(0))
        dist.barrier(group=self.group)

    def group_key(self):
        key = getattr(self, "_group_key", None)
        if key is None:
            ranks = dist.get_process_group_ranks(self.group or dist.group.WORLD)
            key = self._group_key = ",".join(map(str, ranks))
        return key

    def _record(self, kind, x, direction=None, scale=1):
        # A symbolic trace moves no data; count only real collectives.
        if not is_symbolic(x):
            super()._record(kind, x, direction, scale)

    def _all_reduce(self, x, op):
        out = _detached_copy(x, "all_reduce")
        if not is_symbolic(out):
            self._enter("all_reduce", out)
            dist.all_reduce(out, op=_TORCH_REDUCE_OPS[op], group=self.group)
        return out / self.size() if op == "mean" else out

    def _all_reduce_async(self, x, op):
        out = _detached_copy(x, "all_reduce")
        if is_symbolic(out):
            return lambda: out
        self._enter("all_reduce", out)
        work = dist.all_reduce(
            out, op=_TORCH_REDUCE_OPS[op], group=self.group, async_op=True
        )

        def wait():
            work.wait()
            return out / self.size() if op == "mean" else out

        return wait

    def _all_gather(self, x, axis):
        _check_not_differentiated(x, "all_gather")
        return self.gather(x, axis)

    def _reduce_scatter(self, x, axis, op):
        # reduce_scatter_single splits dimension 0: bring `axis` there. It
        # reads its input without writing it, so no copy is needed beyond
        # the one that moves the axis.
        _check_not_differentiated(x, "reduce_scatter")
        full = x.detach().movedim(axis, 0).contiguous()
        local = full.new_empty((full.shape[0] // self.size(), *full.shape[1:]))
        if not is_symbolic(full):
            self._enter("reduce_scatter", full)
            dist.reduce_scatter_single(
                local, full, op=dist.ReduceOp.SUM, group=self.group
            )
        local = local.movedim(0, axis)
        return local / self.size() if op == "mean" else local

    def _broadcast(self, x, root):
        out = _detached_copy(x, "broadcast")
        if not is_symbolic(out):
            source = dist.get_global_rank(self.group or dist.group.WORLD, root)
            self._enter("broadcast", out)
            dist.broadcast(out, src=source, group=self.group)
        return out

    def gather(self, x, axis):
        """Concatenates every rank's `x` along `axis` (not counted)."""
        x = x.contiguous()
        if is_symbolic(x):
            return torch.cat([x] * self.size(), dim=axis)
        parts = [torch.empty_like(x) for _ in range(self.size())]
        self._enter("all_gather", x)
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=axis)

    def local_slice(self, x, axis):
        """A copy of this rank's contiguous slice of `x` along `axis`."""
        if x.shape[axis] % self.size():
            raise ValueError(
                f"Cannot split axis {axis} of shape {tuple(x.shape)} "
                f"evenly across {self.size()} ranks."
            )
        length = x.shape[axis] // self.size()
        # A copy, never a view: a view would keep the full storage alive.
        return _contiguous_copy(x.narrow(axis, self.rank() * length, length))

    def sum_in_place(self, x):
        """Sums `x` over the ranks in place (not counted; symbolic: no-op)."""
        if not is_symbolic(x):
            self._enter("all_reduce", x)
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group)
        return x

    def copy_to_parallel(self, x):
        # Megatron `f`: a replicated input consumed by split weights gets
        # one partial gradient per rank; their sum is the input's gradient.
        def summed_gradient(grad):
            self._record("all_reduce", grad, "backward")
            return self.sum_in_place(_contiguous_copy(grad))

        return _Conjugate.apply(
            x, self, lambda x: x.view_as(x), summed_gradient
        )

    def reduce_from_parallel(self, x):
        # Megatron `g`: the output is replicated, so the gradient arriving
        # on each rank is already that of every rank's partial sum.
        self._record("all_reduce", x, "forward")
        return _Conjugate.apply(
            x, self, lambda x: self.sum_in_place(_contiguous_copy(x)), _identity
        )

    def gather_from_parallel(self, x, axis=-1):
        self._record("all_gather", x, "forward", self.size())
        axis %= x.ndim
        return _Conjugate.apply(
            x,
            self,
            lambda x: self.gather(x, axis),
            lambda grad: self.local_slice(grad, axis),
        )

    def scatter_to_parallel(self, x, axis=-1):
        axis %= x.ndim

        def gathered_gradient(grad):
            self._record("all_gather", grad, "backward", self.size())
            return self.gather(grad, axis)

        return _Conjugate.apply(
            x, self, lambda x: self.local_slice(x, axis), gathered_gradient
        )

    def gather_sequence(self, x, axis=1):
        # Each rank's gradient of the whole sequence is its partial sum.
        local = x.to_local() if isinstance(x, DTensor) else x
        if is_symbolic(local):
            # A symbolic trace keeps every activation whole.
            return local
        axis %= local.ndim
        self._record("all_gather", local, "forward", self.size())

        def scattered_gradient(grad):
            self._record("reduce_scatter", grad, "backward")
            return self._reduce_scatter(grad, axis, "sum")

        return _Conjugate.apply(
            local, self, lambda x: self.gather(x, axis), scattered_gradient
        )

    def reduce_scatter_sequence(self, x, axis=1):
        """As the base class; the shard comes back as a `DTensor` split on
        `axis` over this adapter's ranks, so that the code between the
        regions sees the whole sequence's shape (see
        `keras_tp.runtime.torch.sequence`)."""
        if is_symbolic(x):
            return x.view_as(x)
        axis %= x.ndim
        self._record("reduce_scatter", x, "forward")

        def gathered_gradient(grad):
            self._record("all_gather", grad, "backward", self.size())
            return self.gather(grad, axis)

        local = _Conjugate.apply(
            x,
            self,
            lambda x: self._reduce_scatter(x, axis, "sum"),
            gathered_gradient,
        )
        return DTensor.from_local(
            local, self.device_mesh, [Shard(axis)], run_check=False
        )

    def _gather_partitions(self, x, axis):
        def scattered_gradient(grad):
            with self.stats.labelled("backward"):
                return self.reduce_scatter(grad, axis, "mean")

        return _Conjugate.apply(
            x, self, lambda x: self.gather(x.detach(), axis), scattered_gradient
        )


class _Conjugate(torch.autograd.Function):
    """A collective whose backward pass is another chosen collective.

    `forward(x)` and `backward(grad)` are the adapter's own calls, so each
    operator states its pair in one place, and the backward pass issues
    (and counts) exactly the collective the math needs, or none.
    """

    @staticmethod
    def forward(ctx, x, adapter, forward, backward):
        ctx.adapter = adapter
        ctx.backward_op = backward
        return forward(x)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor):
            # Under sequence parallelism a whole output that met sequence
            # shards has its gradient in shards (or partial sums).
            grad = ctx.adapter.whole_gradient(grad)
        return ctx.backward_op(grad), None, None, None


def _identity(x):
    return x


def _check_not_differentiated(x, name):
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError(
            f"collectives.{name} does not propagate gradients on torch (a "
            "plain torch.distributed collective is invisible to autograd). "
            "In differentiable code use copy_to_parallel, "
            "reduce_from_parallel, gather_from_parallel or "
            "scatter_to_parallel, or pass a detached tensor."
        )


def _detached_copy(x, name):
    """A copy of `x` the in-place `torch.distributed` calls may overwrite."""
    _check_not_differentiated(x, name)
    return _contiguous_copy(x.detach())


def _contiguous_copy(x):
    # torch.distributed writes into dense buffers in place.
    return x.clone(memory_format=torch.contiguous_format)
