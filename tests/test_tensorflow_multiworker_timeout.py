"""A dead TensorFlow worker makes the other raise, naming it, in time.

Two workers of a `MultiWorkerMirroredStrategy` (one CPU replica each, on
loopback ports) train with a collective timeout; one is killed or frozen
mid-training (`tests/tf_scripts/multi_worker_timeout.py`). The survivor
must end with a `keras_tp.RankLostError` naming the lost worker, within the
timeout and a margin.

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
# Seconds for a worker to start, build the strategy and train to the
# failure, or to leave after its error.
MARGIN = 60


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _run_workers(tmp_path, victim, how):
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
            [sys.executable, SCRIPT, str(tmp_path), str(TIMEOUT), victim, how],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        workers.append((process, log))
    survivor = 1 - int(victim)
    try:
        workers[survivor][0].wait(timeout=MARGIN + TIMEOUT)
        exited = time.time()
    finally:
        for process, log in workers:
            # The victim is dead or frozen: only SIGKILL ends it.
            process.kill()
            process.wait()
            log.close()
    log = (tmp_path / f"worker{survivor}.log").read_text()
    failed = json.loads((tmp_path / "failed.json").read_text())["time"]
    ended = json.loads((tmp_path / f"ended{survivor}.json").read_text())
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
