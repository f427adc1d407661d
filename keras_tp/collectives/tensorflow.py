"""TensorFlow adapter: collectives between the replicas of a strategy.

Every rank is a replica of a `tf.distribute` strategy (`MirroredStrategy` on
one host, `MultiWorkerMirroredStrategy` across hosts), and the collectives
run in its replica context. An axis that spans every replica uses
`tf.distribute.ReplicaContext`; an axis that spans part of them (a row or a
column of a `data x model` mesh) uses TensorFlow's collective V2 ops with a
group key of its own (`ReplicaGroups`, in `tensorflow_groups`). TensorFlow
gives `ReplicaContext.all_reduce` the gradient of data parallelism, another
all-reduce, which makes tensor-parallel gradients N times too large; so
every collective here is wrapped in `tf.custom_gradient` with the gradient
tensor parallelism needs, and the backward collectives are explicit (and
counted).
"""

import contextlib
import logging

import tensorflow as tf

from keras_tp.collectives.base import CollectiveAdapter
from keras_tp.collectives.tensorflow_sequence import SequenceShard
from keras_tp.stats import CommunicationStats
from keras_tp.tensors import nbytes

logger = logging.getLogger(__name__)


def _replica_context():
    """The replica context of a non-default strategy, or `None`."""
    if not tf.distribute.has_strategy():
        return None
    return tf.distribute.get_replica_context()


def _first_local_replica():
    """Whether this thread runs the first replica of this host (or none)."""
    context = _replica_context()
    if context is None:
        return True
    replica_id = tf.get_static_value(context.replica_id_in_sync_group)
    local_replicas = len(context.strategy.extended.worker_devices)
    return replica_id is None or int(replica_id) % local_replicas == 0


class ReplicaStats(CommunicationStats):
    """`CommunicationStats` that count what one rank issues.

    `tf.distribute` runs every replica's function in a thread of its own, so
    each collective is issued once per replica. Only the first replica of
    each host records it, as on the other backends where a rank counts its
    own calls.
    """

    @contextlib.contextmanager
    def recording(self, phase):
        if not _first_local_replica():
            # The first replica keeps the ledger; the others must not reset
            # what it recorded.
            yield
            return
        with super().recording(phase):
            yield

    def record(self, kind, nbytes, direction=None, axis="model"):
        if _first_local_replica():
            super().record(kind, nbytes, direction, axis)


class TensorFlowCollectiveAdapter(CollectiveAdapter):
    """Collectives over the replicas of a `tf.distribute` strategy.

    Valid in the replica context of the strategy (inside `strategy.run`),
    which is where the TensorFlow runtime runs every sharded region. Each
    operation is a `tf.custom_gradient` whose backward pass is the one tensor
    parallelism needs (Megatron's conjugate operators); in particular the
    gradient of a sum over ranks is never all-reduced again.

    Without `groups` the axis spans every replica and the collectives are
    those of `ReplicaContext`; with `groups` each replica talks to its own
    group only (a row or a column of the mesh), through collective V2 ops,
    which run in traced functions only.

    TensorFlow has no reduce-scatter on CPUs (`CollectiveReduceScatterV2` is
    implemented for NCCL only), so `reduce_scatter` is an all-reduce of the
    whole tensor followed by a local slice: each rank receives N times the
    bytes it keeps, about twice the network traffic of a true
    reduce-scatter. `all_reduce` with `max` or `min` is an all-gather
    followed by a local reduction and has no gradient.

    Args:
        axis_size: number of replicas (ranks) on the axis.
        axis_name: name of the mesh axis the collectives run over.
        groups: `{replica id: member}` from `ReplicaGroups.split`, or `None`
            for an axis over every replica.

    Example:

    ```python
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    adapter = TensorFlowCollectiveAdapter(axis_size=2)

    def replica_step():
        with adapter.activated():
            partial = tf.fill([3], float(keras_tp.collectives.rank() + 1))
            return keras_tp.collectives.reduce_from_parallel(partial)

    strategy.run(replica_step)  # [3., 3., 3.] on both replicas
    ```
    """

    backend = "tensorflow"

    def __init__(self, axis_size, axis_name="model", groups=None):
        super().__init__(axis_name)
        self.stats = ReplicaStats()
        self._axis_size = axis_size
        self._groups = groups

    def rank(self):
        """This replica's index on the axis: a Python int when TensorFlow
        knows it statically (always for `MirroredStrategy`), else an int32
        tensor."""
        replica_id = self._context().replica_id_in_sync_group
        static = tf.get_static_value(replica_id)
        if self._axis_size == 1:
            return 0
        if self._groups is not None:
            return self._groups[int(static)].rank
        return replica_id if static is None else int(static)

    def size(self):
        return self._axis_size

    def barrier(self):
        """All-reduces a scalar, so no rank passes it before all arrive.

        Returns:
            The reduced scalar. In a traced function, make later work depend
            on it (`tf.control_dependencies`) or the graph may prune it.
        """
        return self._sum(tf.zeros([]))

    def _context(self):
        context = _replica_context()
        if context is None:
            raise RuntimeError(
                "TensorFlow collectives of keras_tp run in the replica "
                "context of the strategy (inside `strategy.run`), as in the "
                "call of a layer sharded by `TensorParallelKeras`."
            )
        return context

    def _record(self, kind, x, direction=None, scale=1):
        shape = tf.TensorShape(x.shape)
        if not shape.is_fully_defined():
            # Recording happens while the step is traced; a dimension left
            # unknown (a retraced, shape-relaxed step) has no byte count.
            logger.debug(
                "%s of a tensor of shape %s: bytes not counted.", kind, shape
            )
            self.stats.record(kind, 0, direction, self.stats_axis)
            return
        self.stats.record(kind, nbytes(x) * scale, direction, self.stats_axis)

    def _member(self):
        replica_id = self._context().replica_id_in_sync_group
        return self._groups[int(tf.get_static_value(replica_id))]

    def _sum(self, x):
        """The raw all-reduce sum, with TensorFlow's own gradient."""
        if self._axis_size == 1:
            # A one-rank axis (no data axis, say) has nothing to exchange.
            return tf.identity(x)
        if self._groups is None:
            return self._context().all_reduce(tf.distribute.ReduceOp.SUM, x)
        return self._member().all_reduce(x)

    def _gather(self, x, axis):
        """The raw all-gather along `axis`, with TensorFlow's own gradient."""
        axis = axis % len(x.shape)
        if self._axis_size == 1:
            gathered = tf.identity(x)
        elif self._groups is None:
            gathered = self._context().all_gather(x, axis)
        else:
            # The group gathers along the first axis.
            order = list(range(len(x.shape)))
            order[0], order[axis] = axis, 0
            gathered = self._member().all_gather(tf.transpose(x, order))
            gathered = tf.transpose(gathered, order)
        # TensorFlow allows uneven pieces, so it drops the static shape; the
        # pieces here are even.
        shape = tf.TensorShape(x.shape).as_list()
        if shape[axis] is not None:
            shape[axis] *= self._axis_size
        return tf.ensure_shape(gathered, shape)

    def _local_slice(self, x, axis):
        """This rank's 1/N slice of `x` along `axis`."""
        pieces = tf.split(x, self._axis_size, axis=axis)
        rank = self.rank()
        if isinstance(rank, int):
            return pieces[rank]
        return tf.gather(tf.stack(pieces), rank)

    def _all_reduce(self, x, op):
        if op in ("max", "min"):
            reduce = tf.reduce_max if op == "max" else tf.reduce_min
            return _conjugate(
                x,
                lambda x: reduce(self._gather(tf.expand_dims(x, 0), 0), 0),
                _no_gradient(f"all_reduce(op={op!r})"),
            )
        total = self._sum_reduced_on_every_rank(x)
        return total / self._axis_size if op == "mean" else total

    def _sum_reduced_on_every_rank(self, x):
        # The sum is consumed identically by every rank, so the cotangent
        # each rank holds is already the full one: pass it through.
        return _conjugate(x, self._sum, lambda grad: grad)

    def _all_gather(self, x, axis):
        axis = axis % len(x.shape)

        def grad(upstream):
            # Each rank's cotangent covers every slice: sum them and keep
            # this rank's slice (a reduce-scatter).
            self._record("all_reduce", upstream, "backward")
            return self._local_slice(self._sum(upstream), axis)

        return _conjugate(x, lambda x: self._gather(x, axis), grad)

    def _reduce_scatter(self, x, axis, op):
        axis = axis % len(x.shape)

        def averaged(t):
            return t / self._axis_size if op == "mean" else t

        def grad(upstream):
            self._record("all_gather", upstream, "backward", self._axis_size)
            return averaged(self._gather(upstream, axis))

        return _conjugate(
            x, lambda x: averaged(self._local_slice(self._sum(x), axis)), grad
        )

    def gather_sequence(self, x, axis=1):
        local = x.local if isinstance(x, SequenceShard) else x
        axis = axis % len(local.shape)
        self._record("all_gather", local, "forward", self._axis_size)

        def grad(upstream):
            # Each rank's gradient of the whole sequence is its partial sum.
            self._record("reduce_scatter", upstream, "backward")
            return self._local_slice(self._sum(upstream), axis)

        return _conjugate(local, lambda x: self._gather(x, axis), grad)

    def regather_sequence(self, shard, axis=1):
        """A sequence shard all-gathered again in the backward pass, for
        the gradients of the weights that read it whole: counted, and
        without a gradient of its own."""
        local = tf.stop_gradient(shard)
        self._record("all_gather", local, "backward", self._axis_size)
        return self._gather(local, axis)

    def reduce_scatter_sequence(self, x, axis=1):
        """As the base class, for the sequence axis (1); the shard comes
        back as a `SequenceShard`, whose shape is the whole sequence's, so
        that the code between the regions reads the whole sequence's
        length (see `keras_tp.collectives.tensorflow_sequence`)."""
        axis = axis % len(x.shape)
        self._record("reduce_scatter", x, "forward")
        local = self._reduce_scatter(x, axis, "sum")
        return SequenceShard(local=local, length=x.shape[axis])

    def _gather_partitions(self, x, axis):
        def grad(upstream):
            self._record("reduce_scatter", upstream, "backward")
            local = self._local_slice(self._sum(upstream), axis)
            return local / self._axis_size

        return _conjugate(x, lambda x: self._gather(x, axis), grad)

    def _broadcast(self, x, root):
        # Zero every rank's value but the root's: the sum is the root's value.
        keep = tf.cast(tf.equal(self.rank(), root), x.dtype)
        return self._sum_reduced_on_every_rank(x * keep)

    def broadcast_gradient(self, x, root=0):
        """`broadcast` of a gradient, counted in the backward pass."""
        self._record("broadcast", x, "backward")
        return self._broadcast(x, root)

    def copy_to_parallel(self, x):
        def grad(upstream):
            self._record("all_reduce", upstream, "backward")
            return self._sum(upstream)

        return _conjugate(x, tf.identity, grad)

    def reduce_from_parallel(self, x):
        self._record("all_reduce", x, "forward")
        return self._sum_reduced_on_every_rank(x)

    def gather_from_parallel(self, x, axis=-1):
        axis = axis % len(x.shape)
        self._record("all_gather", x, "forward", self._axis_size)
        # The gathered output is replicated, so its cotangent is the same on
        # every rank: keeping the local slice needs no collective.
        return _conjugate(
            x,
            lambda x: self._gather(x, axis),
            lambda grad: self._local_slice(grad, axis),
        )

    def scatter_to_parallel(self, x, axis=-1):
        axis = axis % len(x.shape)

        def grad(upstream):
            self._record("all_gather", upstream, "backward", self._axis_size)
            return self._gather(upstream, axis)

        return _conjugate(x, lambda x: self._local_slice(x, axis), grad)


def _conjugate(x, forward, backward):
    """`forward(x)`, whose gradient is `backward(upstream)`.

    Each operator states its pair of collectives in one place, so the
    backward pass issues (and counts) exactly the collective the math
    needs, or none.
    """

    @tf.custom_gradient
    def conjugate(x):
        return forward(x), backward

    return conjugate(x)


def _no_gradient(name):
    def grad(upstream):
        raise NotImplementedError(
            f"keras_tp's TensorFlow {name} has no gradient; use `op='sum'` "
            "or `op='mean'` on a differentiated path."
        )

    return grad
