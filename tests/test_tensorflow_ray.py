"""keras_tp's TensorFlow workers under Ray Train's `TensorflowTrainer`, on a
local Ray cluster (see `tests/ray_cases.py`): Ray sets each worker's
`TF_CONFIG`, and the training function calls `configure_multi_worker()`
first.

Run with `KERAS_BACKEND=tensorflow python -m pytest
tests/test_tensorflow_ray.py` where Ray Train is installed (`pip install
-e ".[ray]"`; the `dev` extra has it).
"""

import keras
import pytest

if keras.backend.backend() != "tensorflow":
    pytest.skip(
        "TensorFlow tests; run with KERAS_BACKEND=tensorflow",
        allow_module_level=True,
    )

from ray.train.tensorflow import TensorflowTrainer  # noqa: E402

from tests import ray_cases  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return ray_cases.run(tmp_path_factory.mktemp("ray"), TensorflowTrainer)


def test_a_restarted_run_resumes_from_the_reported_checkpoint(run):
    ray_cases.check_resumed(*run)


def test_ray_merges_the_workers_pieces_into_one_checkpoint(run):
    result, _ = run
    # One replica per worker.
    ray_cases.check_merged(
        result, ["replica0.safetensors", "replica1.safetensors"]
    )
