"""A job of several processes speaks through its first process.

`one_speaker` runs in every process of a job (torch ranks, TensorFlow
workers, JAX processes); `check_one_speaker` checks all of their results.
"""

import contextlib
import io
import os

import keras

import keras_tp
from tests import models
from tests.models import loss_fn
from tests.models import max_diff

EPOCHS = 2


def one_speaker(directory, process, predict=True, **wrap):
    """Wraps the test MLP, which process `p` first shifts by `p`, then
    fits, evaluates and predicts with progress bars and callbacks on.

    Args:
        directory: where each process's `CSVLogger` writes its own file.
        process: this process's index in the job.
        predict: whether to predict too (with evaluate's progress bar).
        **wrap: the `TensorParallelKeras` arguments of the job.

    Returns:
        Plain numbers: how far the wrapped weights are from process 0's,
        whether this process printed, wrote its CSV file and ran a
        callback that is not a log writer on every epoch.
    """
    model = models.mlp()
    for variable in model.trainable_variables:
        variable.assign(variable + process)
    tp = keras_tp.TensorParallelKeras(model, **wrap)
    start = max_diff(tp.get_weights(), models.mlp().get_weights())
    tp.compile(optimizer="sgd", loss=loss_fn())
    x, y = models.data_for("mlp", batch=16)
    csv = os.path.join(directory, f"process{process}.csv")
    epochs = []
    callbacks = [
        keras.callbacks.CSVLogger(csv),
        keras.callbacks.LambdaCallback(
            on_epoch_end=lambda epoch, logs: epochs.append(epoch)
        ),
    ]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        tp.fit(x, y, batch_size=8, epochs=EPOCHS, callbacks=callbacks)
        tp.evaluate(x, y, batch_size=8, verbose=1)
        if predict:
            tp.predict(x, batch_size=8, verbose=1)
    return {
        "process": process,
        "start_difference": float(start),
        "printed": printed.getvalue(),
        "wrote_csv": os.path.exists(csv),
        "epochs_run": len(epochs),
    }


def check_one_speaker(results):
    """Asserts that every process started from process 0's weights and
    ran every epoch, and that only process 0 printed and wrote logs."""
    assert sorted(r["process"] for r in results) == list(range(len(results)))
    for result in results:
        first = result["process"] == 0
        assert result["start_difference"] == 0.0, result
        assert result["epochs_run"] == EPOCHS, result
        assert result["wrote_csv"] == first, result
        # The progress bars of the 2 epochs and of evaluate.
        assert result["printed"].count("step") >= (3 if first else 0), result
        assert bool(result["printed"].strip()) == first, result
