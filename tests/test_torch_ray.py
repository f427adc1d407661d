"""keras_tp's torch ranks under Ray Train, on a local Ray cluster.

Run with `KERAS_BACKEND=torch python -m pytest tests/test_torch_ray.py`
where Ray Train is installed (`pip install -e ".[ray]"`; the `dev` extra
has it). The test starts a Ray cluster of 2 CPUs in this process; one
`TorchTrainer` run of 2 workers trains the MLP split over them, loses a
worker after its second epoch, is restarted by Ray and resumes from the
checkpoint `ReportCheckpoint` reported.
"""

import os
import pathlib

import keras
import pytest

if keras.backend.backend() != "torch":
    pytest.skip(
        "torch backend tests; run with KERAS_BACKEND=torch",
        allow_module_level=True,
    )

import ray  # noqa: E402
import ray.train  # noqa: E402
from ray.train.torch import TorchTrainer  # noqa: E402

import keras_tp  # noqa: E402
from tests import models  # noqa: E402
from tests.torch_scripts import ray_train  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """The result of the restarted run, and the epoch each attempt of
    each worker started from."""
    root = tmp_path_factory.mktemp("ray")
    log = root / "attempts"
    log.mkdir()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env={
            "env_vars": {"KERAS_BACKEND": "torch", "PYTHONPATH": str(REPO)}
        },
    )
    try:
        trainer = TorchTrainer(
            ray_train.train_fn,
            train_loop_config={"log": str(log)},
            scaling_config=ray.train.ScalingConfig(num_workers=2),
            run_config=ray.train.RunConfig(
                storage_path=str(root / "results"),
                name="keras_tp",
                failure_config=ray.train.FailureConfig(max_failures=1),
            ),
        )
        result = trainer.fit()
    finally:
        ray.shutdown()
    starts = {path.name: int(path.read_text()) for path in log.iterdir()}
    return result, starts


def one_device_losses():
    model = ray_train.compiled(models.mlp())
    x, y = ray_train.data()
    history = model.fit(
        x,
        y,
        batch_size=ray_train.BATCH,
        epochs=ray_train.EPOCHS,
        shuffle=False,
        verbose=0,
    )
    return history.history["loss"]


def test_a_restarted_run_resumes_from_the_reported_checkpoint(run):
    result, starts = run
    # Attempt 0 started from scratch and was lost after epoch 2; Ray
    # restarted both workers, which resumed from the last checkpoint its
    # controller had registered: epoch 2's, or epoch 1's when the worker
    # died before the controller took epoch 2's report (seen once in CI,
    # on a loaded machine). Either way both resume from the same epoch.
    assert starts["attempt0-rank0"] == starts["attempt0-rank1"] == 0
    assert starts["attempt1-rank0"] == starts["attempt1-rank1"]
    assert starts["attempt1-rank0"] in (1, 2), starts
    assert len(starts) == 4, starts
    assert result.metrics["epoch"] == ray_train.EPOCHS
    # The loss curve continues: the last epoch's loss is one device's.
    expected = one_device_losses()[-1]
    assert abs(result.metrics["loss"] - expected) <= 1e-5, (
        result.metrics,
        expected,
    )


def test_ray_merges_the_workers_pieces_into_one_checkpoint(run):
    result, _ = run
    plain = ray_train.compiled(models.mlp(seed=9))
    with result.checkpoint.as_directory() as directory:
        names = os.listdir(directory)
        info = keras_tp.load_checkpoint(plain, directory)
    # Each worker wrote its own rank's pieces; the first, the manifest.
    assert {name.split("-")[-1] for name in names if "rank" in name} >= {
        "rank0.safetensors",
        "rank1.safetensors",
    }, names
    assert info["epoch"] == ray_train.EPOCHS
    assert info["mesh"]["world_size"] == 2
    reference = ray_train.compiled(models.mlp())
    x, y = ray_train.data()
    reference.fit(
        x,
        y,
        batch_size=ray_train.BATCH,
        epochs=ray_train.EPOCHS,
        shuffle=False,
        verbose=0,
    )
    assert models.max_diff(plain.get_weights(), reference.get_weights()) <= 1e-5
