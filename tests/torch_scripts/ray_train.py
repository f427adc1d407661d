"""The training function `tests/test_torch_ray.py` gives Ray Train."""

import os

import keras
import ray.train

import keras_tp
import keras_tp.ray
from tests import models

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

    The first attempt raises after its second epoch's report, as a lost
    worker would, so that Ray restarts the run (`FailureConfig`). Each
    attempt writes the epoch it started from to `config["log"]`.
    """
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
            if attempt == 0 and epoch + 1 == 2:
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
