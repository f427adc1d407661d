"""Collective groups over part of the replicas of a `tf.distribute` strategy.

The rows and columns of a `data x model` mesh, for the axes of
`TensorFlowCollectiveAdapter` that span part of the replicas.
"""

import dataclasses
import itertools

import tensorflow as tf


class ReplicaGroups:
    """Collective groups over parts of the replicas of one strategy.

    `ReplicaContext` collectives always span every replica of a strategy.
    A mesh axis may span only some of them: the `model` ranks of one
    data-parallel row, or the `data` ranks that hold the same
    tensor-parallel shard. Each group made here gets a group key of its own,
    and its members issue TensorFlow's collective V2 ops
    (`CollectiveReduceV2`, `CollectiveGatherV2`) with it, so the groups of
    several axes run side by side on the same devices.

    TensorFlow ranks the members of a group by device name; a group is
    listed here in that order, so that position in the list is the rank.
    All groups share one ordering token per device: every device then issues
    its collectives, of every axis, in program order, as NCCL requires.

    Args:
        devices: the device of every replica, indexed by replica id.
        group_key_start: the first group key. The groups take consecutive
            keys from it, which no other collective of the process (the
            strategy's own included) may use.
        local: the replica ids this process runs, or `None` for all. Across
            the workers of a `MultiWorkerMirroredStrategy` every worker
            splits the same groups, so that the keys agree, and makes the
            members of its own replicas only.
    """

    def __init__(self, devices, group_key_start, local=None):
        self._devices = list(devices)
        self._next_group_key = group_key_start
        self._tokens = {}
        self._local = set(range(len(self._devices)) if local is None else local)

    def split(self, groups):
        """Makes one collective group per list of replica ids.

        Args:
            groups: lists of replica ids, each in device-name order.

        Returns:
            `{replica id: member}` for every replica of the groups that
            this process runs.
        """
        members = {}
        for group in groups:
            names = [self._devices[replica] for replica in group]
            if names != sorted(names):
                raise ValueError(
                    f"Replicas {group} are not listed in device-name order "
                    f"({names}), which is the order TensorFlow ranks them in."
                )
            group_key = self._next_group_key
            self._next_group_key += 1
            for rank, replica in enumerate(group):
                if replica not in self._local:
                    continue
                device = self._devices[replica]
                members[replica] = _GroupMember(
                    group_key, len(group), rank, device, self._token(device)
                )
        return members

    def _token(self, device):
        if device not in self._tokens:
            with tf.init_scope(), tf.device(device):
                self._tokens[device] = tf.Variable(0.0, trainable=False)
        return self._tokens[device]


@dataclasses.dataclass(eq=False)
class _GroupMember:
    """One replica's end of a collective group (see `ReplicaGroups`).

    Each member counts the keys it draws, so the n-th collective of every
    member is the same instance. TensorFlow's collective executor keeps an
    entry for every instance key it has seen (about 1 KiB), and fixes an
    instance's shape when it first runs. A collective whose input shape is
    known when it is traced takes its key then, and keeps it at every run
    of the traced step, as in a TensorFlow graph: its shape never changes.
    One whose shape is known only when it runs (a batch of another size)
    draws a key at every run, as `tf.distribute` does for its own
    collectives.
    """

    group_key: int
    size: int
    rank: int
    device: str
    token: object
    _instance_keys: object = dataclasses.field(
        init=False, default_factory=lambda: itertools.count(1)
    )

    def _instance_key(self, shape):
        if shape.is_fully_defined():
            return self._next_instance_key()
        graph = tf.compat.v1.get_default_graph()
        # The capture belongs to the function graph, not to a branch of a
        # tf.cond inside it.
        while getattr(graph, "is_control_flow_graph", False):
            graph = graph.outer_graph
        if not tf.executing_eagerly() and graph.building_function:
            with graph.as_default():
                # Passing the method itself delays the key to the call of
                # the outermost function when functions are nested.
                return graph.capture_call_time_value(
                    self._next_instance_key, tf.TensorSpec([], tf.int32)
                )
        return self._next_instance_key()

    def _next_instance_key(self):
        with tf.device("/device:CPU:0"):
            return tf.constant(next(self._instance_keys), tf.int32)

    def all_reduce(self, x):
        """The sum of `x` over the group."""
        return self._collective(
            tf.raw_ops.CollectiveReduceV2, x, merge_op="Add", final_op="Id"
        )

    def all_gather(self, x):
        """Every member's `x` concatenated along the first axis, by rank."""
        return self._collective(tf.raw_ops.CollectiveGatherV2, x)

    def _collective(self, op, x, **attributes):
        if tf.executing_eagerly():
            # Replicas of a MirroredStrategy run one after the other when
            # eager, so the first member would wait forever for the others.
            raise RuntimeError(
                "keras_tp's TensorFlow collectives over part of the replicas "
                "(a mesh axis with data_parallel > 1) only run in a traced "
                "function: call `strategy.run` inside a `tf.function`."
            )
        with tf.device(self.device):
            return op(
                input=x,
                group_size=self.size,
                group_key=self.group_key,
                instance_key=self._instance_key(tf.TensorShape(x.shape)),
                ordering_token=[self.token.handle],
                **attributes,
            )
