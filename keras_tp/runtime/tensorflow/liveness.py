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

The second is a worker that is alive but stuck outside the step (a hung
data loader, a long callback, code that runs on one worker only). The
worker whose collective timed out asks the others where they are through
the coordination service's key-value store: a thread of each worker waits
for that request and answers with its main thread's Python stack and
whether that thread is inside a traced step (`keras_tp.runtime.stuck`).
The workers outside it are named in a `RankStuckError`. TensorFlow runs
the collectives inside the traced step, so no worker counts the ones it
entered at run time (`keras_tp.collectives.recorder` holds what torch
ranks enter): the stack says where a stuck worker is.
"""

import importlib
import json
import logging
import re
import threading
import time

import tensorflow as tf

# Private: the coordination service's key-value store and configuration
# have no public API.
from tensorflow.python.eager import context

from keras_tp import elastic
from keras_tp.errors import RankLostError
from keras_tp.errors import RankStuckError
from keras_tp.runtime import stuck

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
_TIMED_OUT = "Collective has timed out"
# The jobs whose tasks TensorFlow's coordination service coordinates.
_COORDINATED_JOBS = ("chief", "worker")
# The coordination service's keys of the stuck-worker diagnosis.
_REQUEST_KEY = "keras_tp/stuck/request"
_REPORT_KEY = "keras_tp/stuck/report/{job}/{task}"
# How long the diagnosis waits for the other workers' reports in all.
REPORT_SECONDS = 5.0
# A worker's thread looks for a request this often, each look a short
# read: a read that waited long would hold the service's client, which
# TensorFlow's own abort of a failed collective needs (a worker hung so).
_POLL_SECONDS = 0.5
_READ_MS = 20
# A main thread among whose innermost frames one of these files is runs a
# traced step, whose collectives run inside it.
_STEP_FILES = ("tensorflow/python/eager/",)


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
    `RankLostError` naming the lost workers (`rank_lost_error`), or a
    `RankStuckError` naming live workers stuck outside the step
    (`stuck_worker_error`), which a thread started here answers for this
    worker.

    Args:
        strategy: the `MultiWorkerMirroredStrategy` whose collectives fail.
    """
    global _STRATEGY
    _STRATEGY = strategy
    elastic.install_failure_hook(rank_lost_error)
    resolver = strategy.cluster_resolver
    threading.Thread(
        target=_answer_request,
        args=(resolver.task_type, resolver.task_id),
        name="keras_tp-stuck-report",
        daemon=True,
    ).start()


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
    coordinated = [job for job in _COORDINATED_JOBS if job in cluster.jobs]
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
    if not lost and _TIMED_OUT in text:
        return stuck_worker_error(error, strategy)
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


def stuck_worker_error(error, strategy):
    """A `RankStuckError` naming the workers outside the step, or `None`.

    For a collective that timed out while every worker's heartbeats
    arrived: asks every other worker for its report through the
    coordination service and names those whose main thread is not inside
    a traced step.

    Args:
        error: the collective's timeout error, raised in this worker.
        strategy: its `MultiWorkerMirroredStrategy`.
    """
    resolver = strategy.cluster_resolver
    cluster = resolver.cluster_spec()
    me = (resolver.task_type, resolver.task_id)
    others = [
        (job, task)
        for job in _COORDINATED_JOBS
        if job in cluster.jobs
        for task in cluster.task_indices(job)
        if (job, task) != me
    ]
    reports = {}
    # In a thread of its own, so that a store that stopped answering
    # leaves the original error to be shown after `REPORT_SECONDS`.
    reader = threading.Thread(
        target=_ask_for_reports, args=(me, others, reports), daemon=True
    )
    reader.start()
    reader.join(REPORT_SECONDS + 1)
    reports = dict(reports)
    outside = sorted(
        w for w, rep in reports.items() if not rep["in_collective"]
    )
    if not outside:
        return None
    names = ", ".join(_worker_name(*w) for w in outside)
    timeout = _TIMEOUT
    waited = f"after {timeout:g} s" if timeout else "after TensorFlow's limit"
    lines = [
        f"{_worker_name(*me).capitalize()}: a collective timed out {waited} "
        f"while every worker's heartbeats arrived, and {names} never "
        "reached it: alive, but stuck outside the training step. "
        "TensorFlow runs the collectives inside its traced step, so the "
        "workers report where they are, not which collective they entered."
    ]
    for job, task in outside:
        lines.append(
            f"{_worker_name(job, task).capitalize()} "
            f"({cluster.task_address(job, task)}) is outside the step; its "
            f"Python stack (innermost last):\n"
            f"{stuck.stack_text(reports[(job, task)])}"
        )
    silent = [_worker_name(*w) for w in others if w not in reports]
    if silent:
        lines.append(
            f"{', '.join(silent).capitalize()} did not report where they are "
            "in time."
        )
    lines.append(
        stuck.advice(
            names,
            "worker",
            "configure_multi_worker(collective_timeout=...) or "
            f"{elastic.COLLECTIVE_TIMEOUT_VARIABLE}",
            error,
            next(
                line.strip().rstrip(".")
                for line in str(error).splitlines()
                if _TIMED_OUT in line
            ),
        )
    )
    return RankStuckError(
        "\n\n".join(lines),
        ranks=[task for _, task in outside],
        rank=resolver.task_id,
    )


def _ask_for_reports(me, workers, reports):
    """Asks every worker for its report through the coordination service;
    fills `reports` with those of `workers` that come within
    `REPORT_SECONDS` in all."""
    store = context.context()
    try:
        store.set_config_key_value(
            _REQUEST_KEY, json.dumps({"from": list(me), "time": time.time()})
        )
    except tf.errors.AlreadyExistsError:
        pass  # Another worker asked first: the answers are the same.
    deadline = time.monotonic() + REPORT_SECONDS
    for job, task in workers:
        wait = max(0.1, deadline - time.monotonic())
        key = _REPORT_KEY.format(job=job, task=task)
        try:
            reports[(job, task)] = json.loads(
                store.get_config_key_value(key, int(wait * 1000))
            )
        except tf.errors.OpError:
            continue  # Silent: named in the error.


def _answer_request(job, task):
    """A worker's thread: waits for a stuck-worker request, then publishes
    this worker's report (`keras_tp.runtime.stuck.report`) once."""
    store = context.context()
    while True:
        time.sleep(_POLL_SECONDS)
        try:
            request = store.get_config_key_value(_REQUEST_KEY, _READ_MS)
        except tf.errors.DeadlineExceededError:
            continue
        except Exception:
            return  # The service is gone: the job is ending.
        try:
            store.set_config_key_value(
                _REPORT_KEY.format(job=job, task=task),
                json.dumps(stuck.report(json.loads(request), _STEP_FILES)),
            )
        except Exception:
            # The asking worker reads a missing report as silence.
            logger.debug("Could not publish the stuck-worker report.")
        return


def _coordination_leader(cluster):
    from tensorflow.python.distribute import multi_worker_util

    return multi_worker_util.coordination_leader(cluster)


def _worker_name(job, task):
    return f"worker {task}" if job == "worker" else f"{job} {task}"
