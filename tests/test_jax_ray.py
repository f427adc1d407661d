"""keras_tp's JAX processes under Ray Train's `JaxTrainer`, on a local Ray
cluster (see `tests/ray_cases.py`): on CPU workers the training function's
`keras_tp.initialize_distributed()` starts `jax.distributed` over them.
The run loses no worker (Ray's restart and `ReportCheckpoint`'s resume are
tested on torch and TensorFlow).

Run with `KERAS_BACKEND=jax python -m pytest tests/test_jax_ray.py` where
Ray Train is installed (`pip install -e ".[ray]"`; the `dev` extra has
it).
"""

import keras
import pytest

if keras.backend.backend() != "jax":
    pytest.skip(
        "JAX backend tests; run with KERAS_BACKEND=jax",
        allow_module_level=True,
    )

from ray.train.v2.jax import JaxTrainer  # noqa: E402

from tests import ray_cases  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return ray_cases.run(tmp_path_factory.mktemp("ray"), JaxTrainer, False)


def test_the_run_reports_one_devices_loss(run):
    result, starts = run
    assert sorted(starts) == ["attempt0-rank0", "attempt0-rank1"]
    ray_cases.check_one_device_loss(result)


def test_ray_merges_the_workers_pieces_into_one_checkpoint(run):
    result, _ = run
    # One CPU device per worker; JAX numbers process 1's from 2048.
    ray_cases.check_merged(result, ["cpu0.safetensors", "cpu2048.safetensors"])
