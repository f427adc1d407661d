"""`AsyncDataParallel` on torch: a process per worker and per server.

Run alone: `KERAS_BACKEND=torch python -m pytest tests/test_torch_async.py`.
One launch of 4 ranks (2 workers, 2 servers) trains every configuration
(`tests/torch_scripts/async_checks.py`); the oracle of `max_staleness=0`
is the same model trained by Keras on one device.
"""

import keras
import numpy as np
import pytest

if keras.backend.backend() != "torch":
    pytest.skip(
        "torch backend tests; run with KERAS_BACKEND=torch",
        allow_module_level=True,
    )

import keras_tp  # noqa: E402
from keras_tp.launcher import launch  # noqa: E402
from tests import async_cases  # noqa: E402
from tests import models  # noqa: E402
from tests import mpi_jobs  # noqa: E402
from tests.torch_scripts import async_checks  # noqa: E402

MAX_STALENESS = 2
LAUNCH_TIMEOUT = 300


@pytest.fixture(scope="module")
def ranks():
    return launch(
        async_checks.checks,
        world_size=async_checks.WORKERS + async_checks.SERVERS,
        args=(MAX_STALENESS,),
        timeout=LAUNCH_TIMEOUT,
    )


def test_synchronous_matches_one_device_on_every_rank(ranks):
    updates = async_cases.SAMPLES // async_cases.BATCH
    for rank in ranks:
        run = rank["synchronous"]
        assert run["weights"] < 1e-5
        np.testing.assert_allclose(
            run["losses"], run["reference_losses"], rtol=1e-5
        )
        np.testing.assert_allclose(*run["evaluate"], rtol=1e-5)
        assert run["histograms"] == [{0: updates * async_checks.WORKERS}] * 2
    # The same history on every rank, to the bit.
    assert len({repr(rank["synchronous"]["losses"]) for rank in ranks}) == 1


def test_pull_every_computes_from_held_parameters(ranks):
    for rank in ranks:
        run = rank["pull_every"]
        assert run["weights"] < 1e-5
        # Two updates per epoch: 4 slices, then the last 2.
        assert run["histograms"] == [{0: 6}] * 2


def test_staleness_never_exceeds_the_bound(ranks):
    runs = [rank["slow_worker"] for rank in ranks]
    histograms = runs[0]["histograms"]
    seen = {staleness for h in histograms for staleness in h}
    assert max(seen) <= MAX_STALENESS
    # The fast worker did run ahead of the slow one.
    assert max(seen) > 0
    # Each epoch applied every slice once: 8 batches of 2 slices.
    assert [sum(h.values()) for h in histograms] == [16, 16]
    # Every rank ends with the same history (validated on each) and
    # weights.
    assert len(runs[0]["history"]["val_loss"]) == 2
    for run in runs[1:]:
        assert run == runs[0]


def test_each_server_holds_only_its_partition(ranks):
    servers = [
        rank["synchronous"]["server"]
        for rank in ranks
        if "server" in rank["synchronous"]
    ]
    assert sorted(s["index"] for s in servers) == [0, 1]
    model_bytes = servers[0]["model_bytes"]
    assert sum(s["parameter_bytes"] for s in servers) == model_bytes
    for server in servers:
        assert server["parameter_bytes"] == server["partition_bytes"]
        assert 0 < server["parameter_bytes"] < model_bytes
        # Adam's two slots per parameter, nothing of the other partition.
        assert server["optimizer_slot_bytes"] == 2 * server["parameter_bytes"]
        scalars = 64
        assert server["held_bytes"] <= 3 * server["parameter_bytes"] + scalars


def test_wrong_world_size_is_refused_on_every_rank(ranks):
    for rank in ranks:
        message = rank["wrong_world_size"]
        assert "workers=2, servers=1" in message
        assert "process group has 4 rank(s)" in message


def test_a_process_not_started_as_a_rank_is_told_how():
    trainer = keras_tp.AsyncDataParallel(mpi_jobs.mlp(), workers=2, servers=1)
    trainer.compile(optimizer="sgd", loss=models.loss_fn())
    x, y = async_cases.data()
    with pytest.raises(RuntimeError, match="not started as a rank") as error:
        trainer.fit(x, y, verbose=0)
    assert "AsyncDataParallel(workers=2, servers=1)" in str(error.value)
    assert "world_size=3" in str(error.value)


def test_device_ids_are_refused():
    trainer = keras_tp.AsyncDataParallel(
        mpi_jobs.mlp(), workers=2, device_ids=["cpu:0", "cpu:1"]
    )
    trainer.compile(optimizer="sgd", loss=models.loss_fn())
    x, y = async_cases.data()
    with pytest.raises(ValueError, match="Leave device_ids out"):
        trainer.fit(x, y, verbose=0)
