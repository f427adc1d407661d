"""Which TensorFlow worker was lost, when a collective fails.

A `MultiWorkerMirroredStrategy` runs TensorFlow's coordination service (on
the chief, or worker 0) that every worker sends heartbeats to. A worker
that misses them for the heartbeat timeout is declared unhealthy, and
every other worker's collectives abort with an `UnavailableError` that
lists it; a worker whose process is gone resets its connections, and the
error names the task it was talking to. Two failures name no one: the
leader itself freezing (the others' heartbeats time out, "RPC:
/tensorflow.CoordinationService/Heartbeat") and a collective that timed
out while every heartbeat arrived ("Collective has timed out"). Here the
first is named (the leader), and the heartbeat timeout is set below the
collective timeout (`detect_dead_workers_within`), so that a dead worker
is named before its collective times out.
"""

import importlib
import logging
import re

import tensorflow as tf

from keras_tp import elastic
from keras_tp.errors import RankLostError

logger = logging.getLogger(__name__)

# TensorFlow's own heartbeat timeout, when none is configured.
DEFAULT_HEARTBEAT_TIMEOUT = 10.0

# The collective timeout of this worker's strategy, for messages.
_TIMEOUT = None
# The `MultiWorkerMirroredStrategy` that `watch` was given.
_STRATEGY = None

_COORDINATION_CONFIG = (
    "tensorflow.compiler.xla.tsl.protobuf.coordination_config_pb2"
)
_TASK = re.compile(r"/job:(\w+)/replica:\d+/task:(\d+)")
_GONE = (
    "Connection reset by peer",
    "Connection refused",
    "Socket closed",
    "failed to connect",
)


def prepare(collective_timeout):
    """Readies the diagnosis, before the strategy exists.

    With a collective timeout, TensorFlow's coordination service declares
    a silent worker dead after half of it (at most its default 10 s), so
    that the error names the dead worker before the collective times out.

    Args:
        collective_timeout: the strategy's collective timeout in seconds,
            or `None`.
    """
    global _TIMEOUT
    _TIMEOUT = collective_timeout
    if collective_timeout:
        detect_dead_workers_within(
            min(DEFAULT_HEARTBEAT_TIMEOUT, collective_timeout / 2)
        )


def watch(strategy):
    """Explains this worker's failed collectives, once `strategy` exists.

    An uncaught collective failure then ends the worker's program with a
    `RankLostError` naming the lost workers (`rank_lost_error`).

    Args:
        strategy: the `MultiWorkerMirroredStrategy` whose collectives fail.
    """
    global _STRATEGY
    _STRATEGY = strategy
    elastic.install_failure_hook(rank_lost_error)


def detect_dead_workers_within(seconds):
    """Sets how long TensorFlow's coordination service waits for heartbeats.

    A worker silent for `seconds` is declared dead, and every other
    worker's collectives fail naming it. Must run before the strategy is
    created (it configures the service as the strategy would, with this
    timeout); does nothing for tasks the service does not coordinate.

    Args:
        seconds: the heartbeat timeout.
    """
    # Private modules: the heartbeat timeout has no public setting, and
    # the strategy configures the service only when nobody did before.
    from tensorflow.python.distribute import multi_worker_util
    from tensorflow.python.eager import context

    try:
        config_pb2 = importlib.import_module(_COORDINATION_CONFIG)
    except ImportError:
        logger.info(
            "This TensorFlow has no %s; dead workers are detected after "
            "TensorFlow's default heartbeat timeout.",
            _COORDINATION_CONFIG,
        )
        return
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    cluster = multi_worker_util.normalize_cluster_spec(resolver.cluster_spec())
    coordinated = [job for job in ("chief", "worker") if job in cluster.jobs]
    if resolver.task_type not in coordinated:
        return
    context.context().configure_coordination_service(
        service_type="standalone",
        service_leader=multi_worker_util.coordination_leader(cluster),
        heartbeat_timeout_in_ms=int(seconds * 1000),
        coordinated_jobs=[
            config_pb2.CoordinatedJob(
                name=job, num_tasks=cluster.num_tasks(job)
            )
            for job in coordinated
        ],
    )


def rank_lost_error(error):
    """A `RankLostError` naming the workers that made `error` happen.

    Args:
        error: an exception raised in this worker.

    Returns:
        A `RankLostError` (not raised) if `error` is a failed collective
        whose message, read as above, names lost workers; else `None`.
    """
    strategy = _STRATEGY
    if strategy is None or not isinstance(error, tf.errors.OpError):
        return None
    resolver = strategy.cluster_resolver
    cluster = resolver.cluster_spec()
    me = (resolver.task_type, resolver.task_id)
    text = str(error)
    if "stopped sending heartbeats" in text:
        why = "stopped sending heartbeats (TensorFlow declared it unhealthy)"
    elif any(marker in text for marker in _GONE):
        why = "is gone: its connection closed"
    else:
        why = "stopped responding"
    lost = {
        (job, int(task)): why
        for job, task in _TASK.findall(text)
        if (job, int(task)) != me
    }
    if not lost and "CoordinationService/Heartbeat" in text:
        leader = _TASK.search(_coordination_leader(cluster))
        lost[(leader.group(1), int(leader.group(2)))] = (
            "stopped answering: it runs TensorFlow's coordination service, "
            "and heartbeats to it timed out"
        )
    if not lost:
        return None
    names = "; ".join(
        f"{_worker_name(job, task)} ({cluster.task_address(job, task)}) {why}"
        for (job, task), why in sorted(lost.items())
    )
    reported = next(
        (line.strip() for line in text.splitlines() if "aborted" in line),
        text.strip().splitlines()[0] if text.strip() else "",
    )
    timeout = _TIMEOUT
    return RankLostError(
        f"{_worker_name(*me).capitalize()}: a collective failed because "
        f"{names}. TensorFlow's error: {type(error).__name__}: "
        f"{reported[:300].rstrip('.:')}. Collectives wait at most "
        f"{f'{timeout:g} s' if timeout else 'without limit'} "
        f"({elastic.COLLECTIVE_TIMEOUT_VARIABLE}, or "
        "configure_multi_worker(collective_timeout=...)). Restart the "
        "workers and resume from your last checkpoint.",
        ranks=sorted(task for _, task in lost),
        rank=resolver.task_id,
    )


def _coordination_leader(cluster):
    from tensorflow.python.distribute import multi_worker_util

    return multi_worker_util.coordination_leader(cluster)


def _worker_name(job, task):
    return f"worker {task}" if job == "worker" else f"{job} {task}"
