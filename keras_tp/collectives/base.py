"""The collective interface every backend adapter implements."""

import contextlib
import contextvars

from keras_tp.collectives import recorder
from keras_tp.stats import CommunicationStats
from keras_tp.tensors import nbytes

REDUCE_OPS = ("sum", "mean", "max", "min")

_CURRENT_ADAPTER = contextvars.ContextVar("keras_tp_adapter", default=None)
_PROCESS_ADAPTER = None


class CollectiveAdapter:
    """Collectives over the ranks of one mesh axis, on per-rank tensors.

    Every tensor passed in or returned is the local value of one rank. On JAX
    the methods are only valid inside a sharded region (a `shard_map`); on
    torch and TensorFlow inside a launched process or replica context.

    Subclasses implement the raw collectives (`_all_reduce`, `_all_gather`,
    `_reduce_scatter`, `_broadcast`, `barrier`, `rank`, `size`), the four
    Megatron conjugate operators and ZeRO-3's `_gather_partitions` with the
    backend's custom-gradient tool.
    This class validates arguments and counts calls and bytes in `stats`;
    over one rank a collective is the identity, neither issued nor counted.

    Args:
        axis_name: name of the mesh axis the collectives run over.
    """

    backend = None

    def __init__(self, axis_name="model"):
        self.axis_name = axis_name
        # The axis the stats file calls under; a level of a hierarchical
        # axis (`HierarchicalAdapter`) names itself there, e.g.
        # "data/across_hosts", while its collectives still run over
        # `axis_name`.
        self.stats_axis = axis_name
        self.stats = CommunicationStats()
        # A debug switch for timing only: False makes `all_reduce` (and
        # its async form) return its input, still counted, so that a
        # benchmark times a DDP step without its gradient communication.
        # The results are then wrong.
        self.communicate = True

    def rank(self):
        """Index of this rank along the axis (may be a traced scalar)."""
        raise NotImplementedError

    def size(self):
        """Number of ranks along the axis (a Python int)."""
        raise NotImplementedError

    def all_reduce(self, x, op="sum"):
        """Reduces `x` over all ranks with `op` (sum, mean, max or min)."""
        if op not in REDUCE_OPS:
            raise ValueError(f"`op` must be one of {REDUCE_OPS}, got {op!r}.")
        self._record("all_reduce", x)
        if not self.communicate or self.size() == 1:
            return x
        return self._all_reduce(x, op)

    def all_reduce_async(self, x, op="sum"):
        """Starts `all_reduce(x, op)` and returns without waiting for it.

        Returns:
            A function of no arguments that waits for the collective and
            returns its result. Backends whose collectives run inside a
            compiled step complete it at once; their compiler schedules it.
        """
        if op not in REDUCE_OPS:
            raise ValueError(f"`op` must be one of {REDUCE_OPS}, got {op!r}.")
        self._record("all_reduce", x)
        if not self.communicate or self.size() == 1:
            return lambda: x
        return self._all_reduce_async(x, op)

    def _all_reduce_async(self, x, op):
        result = self._all_reduce(x, op)
        return lambda: result

    def all_gather(self, x, axis=0):
        """Concatenates every rank's `x` along `axis`."""
        self._record("all_gather", x, scale=self.size())
        if self.size() == 1:
            return x
        return self._all_gather(x, axis)

    def reduce_scatter(self, x, axis=0, op="sum"):
        """Reduces `x` over ranks and returns this rank's slice of `axis`."""
        if op not in ("sum", "mean"):
            raise ValueError(f"`op` must be 'sum' or 'mean', got {op!r}.")
        if x.shape[axis] % self.size():
            raise ValueError(
                f"reduce_scatter needs axis {axis} of shape {tuple(x.shape)} "
                f"to divide by the {self.size()} ranks."
            )
        self._record("reduce_scatter", x)
        if self.size() == 1:
            return x
        return self._reduce_scatter(x, axis, op)

    def broadcast(self, x, root=0):
        """Returns rank `root`'s `x` on every rank."""
        self._record("broadcast", x)
        if self.size() == 1:
            return x
        return self._broadcast(x, root)

    def barrier(self):
        """Blocks until every rank reaches this point."""
        raise NotImplementedError

    def copy_to_parallel(self, x):
        """Megatron `f`: identity forward, all-reduce of the gradient."""
        raise NotImplementedError

    def reduce_from_parallel(self, x):
        """Megatron `g`: all-reduce forward, identity gradient."""
        raise NotImplementedError

    def gather_from_parallel(self, x, axis=-1):
        """All-gather along `axis` forward; keep the local slice backward."""
        raise NotImplementedError

    def scatter_to_parallel(self, x, axis=-1):
        """Keep the local slice forward; all-gather the gradient backward."""
        raise NotImplementedError

    def gather_sequence(self, x, axis=1):
        """Sequence parallelism's entry (Megatron-SP's `g-bar`): all-gather
        the sequence shards along `axis` forward; reduce-scatter the
        gradient backward, each rank keeping its shard's sum."""
        raise NotImplementedError

    def reduce_scatter_sequence(self, x, axis=1):
        """Sequence parallelism's exit: reduce the partial sums and keep
        this rank's shard of `axis` forward; all-gather the gradient
        backward. It replaces `reduce_from_parallel`'s all-reduce, with
        the same bytes, and leaves the activation split by `size()`."""
        raise NotImplementedError

    def gather_partitions(self, x, axis):
        """ZeRO-3's gather of a parameter from its partitions along `axis`.

        Forward, an all-gather; backward, the gradient reduce-scattered and
        averaged over the ranks, so each rank receives the mean gradient of
        its own partition.
        """
        self._record("all_gather", x, "forward", self.size())
        return self._gather_partitions(x, axis % len(x.shape))

    def _gather_partitions(self, x, axis):
        raise NotImplementedError

    def _record(self, kind, x, direction=None, scale=1):
        """Counts one call; `scale` turns the input's bytes into the call's
        (an all-gather moves `size()` times its input). A collective over
        one rank moves nothing, and compilers drop it: it is not counted."""
        if self.size() == 1:
            return
        self.stats.record(kind, nbytes(x) * scale, direction, self.stats_axis)

    def _enter(self, kind, x, direction=None):
        """Records that this rank enters a collective of `kind` on `x`.

        Adapters whose ranks are processes (torch) call it right before
        every collective they issue, counted in `stats` or not, so that a
        collective that times out can name the ranks that never entered it
        (`keras_tp.collectives.recorder`). Compiled backends (JAX,
        TensorFlow) issue theirs inside a program, and do not.
        """
        axis = self.stats_axis
        recorder.enter(
            self.group_key(),
            kind,
            tuple(x.shape),
            str(x.dtype).removeprefix("torch."),
            axis="/".join(axis) if isinstance(axis, tuple) else axis,
            phase=self.stats.active_phase,
            direction=direction,
        )

    def group_key(self):
        """The global ranks of this adapter's group, as "0,1" (for the
        records of `_enter`)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def activated(self):
        """Makes this adapter the one `keras_tp.collectives` functions use."""
        token = _CURRENT_ADAPTER.set(self)
        try:
            yield self
        finally:
            _CURRENT_ADAPTER.reset(token)


def set_process_adapter(adapter):
    """Makes `adapter` the one used outside sharded regions.

    Runtimes whose ranks are processes (torch) call it, so that
    `keras_tp.collectives` works anywhere in a rank's code.
    """
    global _PROCESS_ADAPTER
    _PROCESS_ADAPTER = adapter


def current_adapter():
    """Returns the adapter of the enclosing sharded region or process."""
    adapter = _CURRENT_ADAPTER.get() or _PROCESS_ADAPTER
    if adapter is None:
        raise RuntimeError(
            "keras_tp collectives are only available inside a sharded region "
            "(the call of a layer sharded by `TensorParallelKeras`) or inside "
            "a process started by `keras_tp.launch` / `torchrun`."
        )
    return adapter
