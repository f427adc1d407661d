"""Elastic restarts and no hangs on a lost rank, under launch and torchrun.

Each test kills, freezes, hangs or puts to sleep rank 1 of a two-rank job
before step 3 of `tests/torch_scripts/elastic_train.py` and checks that
the survivor raises within the collective timeout, naming rank 1 (and,
for a rank that sleeps, where it is), and that a restarted
job resumes: its losses are the uninterrupted one-device run's.

Run with `KERAS_BACKEND=torch python -m pytest tests/test_torch_elastic.py`.
"""

import json
import os
import subprocess
import sys
import time

import keras
import numpy as np
import pytest

if keras.backend.backend() != "torch":
    pytest.skip(
        "torch backend tests; run with KERAS_BACKEND=torch",
        allow_module_level=True,
    )

import keras_tp  # noqa: E402
from keras_tp import elastic  # noqa: E402
from keras_tp import launcher  # noqa: E402
from keras_tp.collectives import recorder  # noqa: E402
from keras_tp.errors import RankStuckError  # noqa: E402
from keras_tp.runtime.torch import stuck  # noqa: E402
from tests.torch_scripts import elastic_train  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAIL_AT = 3
TIMEOUT = 10
# A stuck rank is named after this collective timeout: short, since
# nothing else waits for it.
STUCK_TIMEOUT = 5
# The diagnosis of a hung rank waits for three missed heartbeats.
DIAGNOSIS = 3


def _read(path):
    with open(path) as f:
        return json.load(f)


def _assert_losses_continue(losses, sizes_after_restart):
    """Every step once, in order; the restart's steps continue the curve."""
    assert [r["step"] for r in losses] == list(range(elastic_train.STEPS))
    before = [r for r in losses if r["step"] < FAIL_AT]
    after = [r for r in losses if r["step"] >= FAIL_AT]
    assert {(r["world_size"], r["restart"]) for r in before} == {(2, 0)}
    assert {(r["world_size"], r["restart"]) for r in after} == {
        (sizes_after_restart, 1)
    }
    # Not reset to the first loss: the same curve as without a failure.
    np.testing.assert_allclose(
        [r["loss"] for r in losses],
        elastic_train.reference_losses(),
        rtol=1e-5,
    )


def test_launch_restarts_on_the_ranks_left_after_a_rank_is_killed(tmp_path):
    losses = keras_tp.launch(
        elastic_train.train,
        world_size=2,
        args=(str(tmp_path), FAIL_AT, "kill"),
        max_restarts=1,
        collective_timeout=TIMEOUT,
        timeout=300,
    )
    _assert_losses_continue(losses, sizes_after_restart=1)
    # The survivor of the first attempt saw the lost connection at once.
    failed = _read(tmp_path / "failed.json")["time"]
    raised = _read(tmp_path / "raised0.json")["time"]
    assert 0 <= raised - failed < TIMEOUT


def test_launch_names_a_frozen_rank_within_the_collective_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(launcher.RankLostError) as error:
        keras_tp.launch(
            elastic_train.train,
            world_size=2,
            args=(str(tmp_path), FAIL_AT, "freeze"),
            collective_timeout=TIMEOUT,
            timeout=300,
        )
    elapsed = time.monotonic() - start
    message = str(error.value)
    assert message.startswith("Rank 0: a collective failed because rank 1")
    assert "is stopped (SIGSTOP" in message
    assert f"at most {TIMEOUT} s (KERAS_TP_COLLECTIVE_TIMEOUT)" in message
    assert error.value.ranks == (1,)
    failed = _read(tmp_path / "failed.json")["time"]
    raised = _read(tmp_path / "raised0.json")["time"]
    # gloo gave up after the timeout, not before and not much after.
    assert TIMEOUT - 1 <= raised - failed <= TIMEOUT + 5
    assert elapsed < 120


def test_launch_names_a_stuck_rank_with_its_stack(tmp_path):
    # Rank 1 sleeps with its heartbeat beating, as in a hung data loader:
    # nothing is lost, and the error says which rank never came.
    with pytest.raises(RankStuckError) as error:
        keras_tp.launch(
            elastic_train.train,
            world_size=2,
            args=(str(tmp_path), FAIL_AT, "sleep"),
            collective_timeout=STUCK_TIMEOUT,
            timeout=300,
        )
    ended = time.time()
    message = str(error.value)
    assert message.startswith(
        f"Rank 0: a collective timed out after {STUCK_TIMEOUT} s "
        "(KERAS_TP_COLLECTIVE_TIMEOUT), and rank(s) 1 never entered it: "
        "rank 0 waited in "
    )
    assert error.value.ranks == (1,)
    assert not isinstance(error.value, launcher.RankLostError)
    assert "Rank 1 last entered all_gather #" in message
    # Its stack shows where it is.
    assert "in _fail\n    time.sleep(3600)" in message
    failed = _read(tmp_path / "failed.json")["time"]
    assert ended - failed <= STUCK_TIMEOUT + 10


def test_a_rank_waiting_for_a_stuck_rank_is_followed_to_it(monkeypatch):
    # 2 x 2 mesh: rank 0 waits in data all-reduce #3 over [0, 2]; rank 2
    # never came, because it waits in model all-reduce #5 over [2, 3],
    # which rank 3, stuck elsewhere, never entered.
    monkeypatch.setenv(elastic.COLLECTIVE_TIMEOUT_VARIABLE, "5")

    def report(counts, group, number, in_collective):
        last = {
            "group": group,
            "number": number,
            "kind": "all_reduce",
            "shape": [4],
            "dtype": "float32",
            "axis": None,
            "phase": "train",
            "direction": None,
            "time": 0.0,
        }
        return {
            "recorder": {"counts": counts, "last": last},
            "stack": f"stack of a rank in {group}",
            "in_collective": in_collective,
        }

    recorder.reset()
    for _ in range(3):
        recorder.enter("0,2", "all_reduce", (4,), "float32", "data", "train")
    reports = {
        1: report({"0,1": 5, "1,3": 3}, "1,3", 3, True),
        2: report({"0,2": 2, "2,3": 5}, "2,3", 5, True),
        3: report({"1,3": 2, "2,3": 4}, "2,3", 4, False),
    }
    error = stuck.stuck_error(0, RuntimeError("x"), "x", reports, 10.0)
    recorder.reset()
    assert error.ranks == (3,)
    message = str(error)
    assert "and rank(s) 2 never entered it: rank 0 waited in all_reduce #3" in (
        message
    )
    assert "Rank 2 waits in all_reduce #5 over ranks [2, 3]" in message
    assert "for rank(s) 3, which never entered it." in message
    assert "Rank 3 last entered all_reduce #4 over ranks [2, 3]" in message
    assert "stack of a rank in 2,3" in message


def test_torchrun_names_a_hung_rank_then_restarts_and_resumes(tmp_path):
    script = os.path.join(ROOT, "tests", "torch_scripts", "elastic_train.py")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=1:1",
            "--nproc-per-node",
            "2",
            "--max-restarts",
            "1",
            script,
            str(tmp_path),
            "hang",
        ],
        env={
            **os.environ,
            "KERAS_BACKEND": "torch",
            "PYTHONPATH": ROOT,
            elastic.COLLECTIVE_TIMEOUT_VARIABLE: str(TIMEOUT),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-5000:]
    # The first attempt's rank 0 ended with the error naming rank 1.
    assert (
        "keras_tp.errors.RankLostError: Rank 0: a collective failed "
        "because rank 1 (pid " in result.stderr
    )
    assert "stopped responding: no heartbeat for 3 s" in result.stderr
    failed = _read(tmp_path / "failed.json")["time"]
    raised = _read(tmp_path / "raised0.json")["time"]
    ended = _read(tmp_path / "attempt0.json")["ended"]
    assert TIMEOUT - 1 <= raised - failed <= TIMEOUT + 5
    assert ended - failed <= TIMEOUT + DIAGNOSIS + 10
    # torchrun restarts every rank of its node: the same size, resumed.
    _assert_losses_continue(
        _read(tmp_path / "losses.json"), sizes_after_restart=2
    )


def test_restart_sizes_follow_min_world_size_and_allowed_sizes():
    sizes = launcher._restart_sizes(4, 2, 1, None)
    assert launcher._next_world_size(sizes, 3) == 3
    sizes = launcher._restart_sizes(8, 2, 2, (8, 4, 2, 1))
    assert sizes == [2, 4, 8]
    assert launcher._next_world_size(sizes, 7) == 4
    assert launcher._next_world_size(sizes, 1) is None
    with pytest.raises(ValueError, match="must contain the world_size"):
        launcher._restart_sizes(4, 1, 1, (2, 1))
    with pytest.raises(ValueError, match="min_world_size=5"):
        launcher._restart_sizes(4, 1, 5, None)


def test_collective_timeout_must_be_positive(monkeypatch):
    monkeypatch.setenv(elastic.COLLECTIVE_TIMEOUT_VARIABLE, "soon")
    with pytest.raises(ValueError, match="KERAS_TP_COLLECTIVE_TIMEOUT='soon'"):
        elastic.collective_timeout()
    monkeypatch.setenv(elastic.COLLECTIVE_TIMEOUT_VARIABLE, "15")
    assert elastic.collective_timeout() == 15.0
    with pytest.raises(ValueError, match="collective_timeout=0"):
        keras_tp.launch(print, world_size=2, collective_timeout=0)
