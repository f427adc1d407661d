"""keras_tp under Ray Train, on a local Ray cluster: the run and its
checks, shared by `tests/test_torch_ray.py` (`TorchTrainer`),
`tests/test_tensorflow_ray.py` (`TensorflowTrainer`) and
`tests/test_jax_ray.py` (`JaxTrainer`).

`run` starts a Ray cluster of 2 CPUs in the test's process; one trainer
run of 2 workers trains the MLP split over them (tensor parallelism across
the workers), loses a worker after its second epoch, is restarted by Ray
and resumes from the checkpoint `ReportCheckpoint` reported. JAX's run
loses no worker: the restart and the resume are Ray's and
`ReportCheckpoint`'s, the same on every backend, and each Ray run costs
the suite a minute or two of CPU in Ray's own processes.
"""

import os
import pathlib

import keras
import ray
import ray.train

import keras_tp
import keras_tp.ray
from tests import models

REPO = pathlib.Path(__file__).resolve().parents[1]
EPOCHS = 3
BATCH = 8
STEPS = 2


def data():
    return models.data_for("mlp", batch=BATCH * STEPS, seed=5)


def compiled(model):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss=models.loss_fn())
    return model


def train_fn(config):
    """Trains the MLP split over Ray's workers for `EPOCHS` epochs.

    With `config["lose"]`, the first attempt raises after its second
    epoch's report, as a lost worker would, so that Ray restarts the run
    (`FailureConfig`). Each attempt writes the epoch it started from to
    `config["log"]`.
    """
    if keras.backend.backend() == "tensorflow":
        # TensorflowTrainer sets TF_CONFIG; TensorFlow sets up its
        # collectives across workers before its first operation.
        from keras_tp.runtime.tensorflow import configure_multi_worker

        configure_multi_worker()
    else:
        # On JAX, starts jax.distributed over Ray's CPU workers (on GPUs
        # JaxTrainer has done it); on torch, joins Ray's process group.
        keras_tp.initialize_distributed()
    context = ray.train.get_context()
    attempt = len(os.listdir(config["log"])) // context.get_world_size()
    tp = compiled(
        keras_tp.TensorParallelKeras(
            models.mlp(), world_size=context.get_world_size()
        )
    )
    report = keras_tp.ray.ReportCheckpoint()

    class FailOnce(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if config["lose"] and attempt == 0 and epoch + 1 == 2:
                raise RuntimeError("worker lost after epoch 2")

    class StartLog(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            name = f"attempt{attempt}-rank{context.get_world_rank()}"
            with open(os.path.join(config["log"], name), "w") as f:
                f.write(str(report.resumed_epoch or 0))

    x, y = data()
    tp.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[report, StartLog(), FailOnce()],
    )


def run(root, trainer_class, lose=True):
    """`(result, starts)`: the run's result, and the epoch each attempt of
    each worker started from.

    Args:
        root: a fresh directory.
        trainer_class: `TorchTrainer`, `TensorflowTrainer` or
            `JaxTrainer`.
        lose: whether a worker is lost after the second epoch.
    """
    log = root / "attempts"
    log.mkdir()
    backend = keras.backend.backend()
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        runtime_env={
            "env_vars": {"KERAS_BACKEND": backend, "PYTHONPATH": str(REPO)}
        },
    )
    try:
        trainer = trainer_class(
            train_fn,
            train_loop_config={"log": str(log), "lose": lose},
            scaling_config=ray.train.ScalingConfig(num_workers=2),
            run_config=ray.train.RunConfig(
                storage_path=str(root / "results"),
                name="keras_tp",
                # One failure is the lost worker. The other spares a run
                # whose workers failed to start: Ray picks TensorFlow's
                # gRPC ports before the workers bind them, and another
                # test's processes can take one meanwhile (seen once in
                # CI). Such an attempt writes no start log, so the
                # checks below see the same attempts.
                failure_config=ray.train.FailureConfig(max_failures=2),
            ),
        )
        result = trainer.fit()
    finally:
        ray.shutdown()
    starts = {path.name: int(path.read_text()) for path in log.iterdir()}
    return result, starts


def _one_device():
    """The MLP trained on one device: `(model, losses)`."""
    model = compiled(models.mlp())
    x, y = data()
    history = model.fit(
        x, y, batch_size=BATCH, epochs=EPOCHS, shuffle=False, verbose=0
    )
    return model, history.history["loss"]


def check_resumed(result, starts):
    """Both workers resumed from the same reported epoch, and the loss
    curve continued as one device's."""
    # Attempt 0 started from scratch and was lost after epoch 2; Ray
    # restarted both workers, which resumed from the last checkpoint its
    # controller had registered: epoch 2's, or epoch 1's when the worker
    # died before the controller took epoch 2's report (seen once in CI,
    # on a loaded machine). Either way both resume from the same epoch.
    assert starts["attempt0-rank0"] == starts["attempt0-rank1"] == 0
    assert starts["attempt1-rank0"] == starts["attempt1-rank1"]
    assert starts["attempt1-rank0"] in (1, 2), starts
    assert len(starts) == 4, starts
    # The loss curve continues.
    check_one_device_loss(result)


def check_one_device_loss(result):
    """The run's last epoch is reported, with one device's loss."""
    assert result.metrics["epoch"] == EPOCHS
    expected = _one_device()[1][-1]
    assert abs(result.metrics["loss"] - expected) <= 1e-5, (
        result.metrics,
        expected,
    )


def check_merged(result, piece_files):
    """Ray merged the workers' directories into one checkpoint, holding
    `piece_files` (each worker wrote its own pieces, the first the
    manifest), which a plain Keras model loads with one device's
    weights."""
    plain = compiled(models.mlp(seed=9))
    with result.checkpoint.as_directory() as directory:
        names = os.listdir(directory)
        info = keras_tp.load_checkpoint(plain, directory)
    assert {name.split("-")[-1] for name in names} >= set(piece_files), names
    assert info["epoch"] == EPOCHS
    assert info["mesh"]["world_size"] == 2
    reference = _one_device()[0]
    assert models.max_diff(plain.get_weights(), reference.get_weights()) <= 1e-5
