"""A dead TensorFlow worker makes the other raise, naming it, in time.

Two workers of a `MultiWorkerMirroredStrategy` (one CPU replica each, on
loopback ports) train with a collective timeout; one is killed or frozen
mid-training (`tests/tf_scripts/multi_worker_timeout.py`), or sleeps
outside the step while alive. The survivor must end with a
`keras_tp.RankLostError` naming the lost worker (a `RankStuckError` naming
the sleeping one, with its stack), within the timeout and a margin.

Run with `KERAS_BACKEND=tensorflow python -m pytest
tests/test_tensorflow_multiworker_timeout.py`.
"""

import json
import os
import socket
import subprocess
import sys
import time

import keras
import pytest

if keras.backend.backend() != "tensorflow":
    pytest.skip(
        "TensorFlow backend tests; run with KERAS_BACKEND=tensorflow",
        allow_module_level=True,
    )

SCRIPT = os.path.join(
    os.path.dirname(__file__), "tf_scripts", "multi_worker_timeout.py"
)
TIMEOUT = 10
# The stuck worker's case waits for the whole collective timeout: short.
STUCK_TIMEOUT = 5
# Seconds for a worker to start, build the strategy and train to the
# failure, or to leave after its error.
MARGIN = 60


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


class DiedInTensorFlow(Exception):
    """The survivor died on a signal before its Python exit handler ran."""


def _run_workers(tmp_path, victim, how, timeout=TIMEOUT):
    """Starts both workers; returns the survivor's log and its timings."""
    cluster = {"worker": [f"localhost:{_free_port()}" for _ in range(2)]}
    workers = []
    for index in range(2):
        env = dict(
            os.environ,
            KERAS_BACKEND="tensorflow",
            TF_CONFIG=json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": index}}
            ),
        )
        log = open(tmp_path / f"worker{index}.log", "w")
        process = subprocess.Popen(
            [sys.executable, SCRIPT, str(tmp_path), str(timeout), victim, how],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        workers.append((process, log))
    survivor = 1 - int(victim)
    try:
        workers[survivor][0].wait(timeout=MARGIN + timeout)
        exited = time.time()
    finally:
        for process, log in workers:
            # The victim is dead or frozen: only SIGKILL ends it.
            process.kill()
            process.wait()
            log.close()
    log = (tmp_path / f"worker{survivor}.log").read_text()
    failed = json.loads((tmp_path / "failed.json").read_text())["time"]
    ended_path = tmp_path / f"ended{survivor}.json"
    if workers[survivor][0].returncode < 0 and not ended_path.exists():
        raise DiedInTensorFlow(log)
    ended = json.loads(ended_path.read_text())
    return (
        workers[survivor][0].returncode,
        log,
        ended["time"] - failed,
        (exited - failed),
    )


def test_killed_worker_is_named_at_once(tmp_path):
    status, log, raised, exited = _run_workers(tmp_path, "1", "kill")
    assert status != 0
    assert (
        "keras_tp.errors.RankLostError: Worker 0: a collective failed "
        "because worker 1 (localhost:" in log
    ), log[-3000:]
    assert "is gone: its connection closed" in log
    # The connection reset reaches the survivor at once.
    assert raised < TIMEOUT
    assert exited < TIMEOUT + 10


def test_frozen_coordination_leader_is_named_within_the_timeout(tmp_path):
    # Worker 0 runs TensorFlow's coordination service: frozen, nobody
    # declares it dead, and TensorFlow's error names no task.
    status, log, raised, exited = _run_workers(tmp_path, "0", "freeze")
    assert status != 0
    assert (
        "keras_tp.errors.RankLostError: Worker 1: a collective failed "
        "because worker 0 (localhost:" in log
    ), log[-3000:]
    assert "runs TensorFlow's coordination service" in log
    assert raised <= TIMEOUT + 2
    assert exited < TIMEOUT + 10


def test_frozen_worker_is_named_by_its_missed_heartbeats(tmp_path):
    status, log, raised, exited = _run_workers(tmp_path, "1", "freeze")
    assert status != 0
    assert (
        "keras_tp.errors.RankLostError: Worker 0: a collective failed "
        "because worker 1 (localhost:" in log
    ), log[-3000:]
    assert "stopped sending heartbeats" in log
    # Declared dead after half the timeout, before the collective's own.
    assert raised < TIMEOUT
    assert exited < TIMEOUT + 10


def test_sleeping_worker_is_named_with_its_stack(tmp_path):
    # Alive, its heartbeats arriving, but asleep outside the step: only
    # the collective's own timeout ends the wait, and the survivor asks
    # the other worker where it is through the coordination service.
    for attempt in range(2):
        run_dir = tmp_path / f"attempt{attempt}"
        run_dir.mkdir()
        try:
            status, log, raised, _ = _run_workers(
                run_dir, "1", "sleep", timeout=STUCK_TIMEOUT
            )
            break
        except (DiedInTensorFlow, subprocess.TimeoutExpired):
            # TensorFlow 2.21's abort of a timed-out ring all-reduce now
            # and then corrupts a mutex ("RAW: ... Mutex corrupt") or
            # dies on a signal with nothing logged, and the survivor hangs
            # or dies before Python sees the error (before keras_tp's
            # diagnosis runs): one more try.
            log = (run_dir / "worker0.log").read_text()
            assert "Traceback" not in log, log[-3000:]
    else:
        pytest.fail(f"TensorFlow's abort crashed twice: {log[-3000:]}")
    assert status != 0
    assert (
        "keras_tp.errors.RankStuckError: Worker 0: a collective timed out "
        f"after {STUCK_TIMEOUT} s while every worker's heartbeats arrived, "
        "and worker 1 never reached it" in log
    ), log[-3000:]
    assert "Worker 1 (localhost:" in log
    # Its stack, innermost last, ends in the callback's sleep.
    stack = log.split("is outside the step; its Python stack")[1]
    assert "in on_train_batch_end\n    time.sleep(3 * float(TIMEOUT))" in (
        stack
    ), stack[:3000]
    assert "Find what holds worker 1 there" in log
    assert raised <= STUCK_TIMEOUT + 3
