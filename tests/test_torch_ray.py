"""keras_tp's torch ranks under Ray Train's `TorchTrainer`, on a local Ray
cluster (see `tests/ray_cases.py`).

Run with `KERAS_BACKEND=torch python -m pytest tests/test_torch_ray.py`
where Ray Train is installed (`pip install -e ".[ray]"`; the `dev` extra
has it).
"""

import keras
import pytest

if keras.backend.backend() != "torch":
    pytest.skip(
        "torch backend tests; run with KERAS_BACKEND=torch",
        allow_module_level=True,
    )

from ray.train.torch import TorchTrainer  # noqa: E402

from tests import ray_cases  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return ray_cases.run(tmp_path_factory.mktemp("ray"), TorchTrainer)


def test_a_restarted_run_resumes_from_the_reported_checkpoint(run):
    ray_cases.check_resumed(*run)


def test_ray_merges_the_workers_pieces_into_one_checkpoint(run):
    result, _ = run
    ray_cases.check_merged(result, ["rank0.safetensors", "rank1.safetensors"])
