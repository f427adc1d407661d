"""Checkpoint runs shared by every backend's tests.

A run trains a model a few steps, saves a checkpoint, and records what the
model computes at the save (predictions) and right after it (the losses of
the next steps). A run that loads the checkpoint, at any layout and on any
backend, must compute the same: the outputs within float32 rounding, and
the next steps' losses as if training had never stopped.

`python -m tests.checkpoint_cases DIRECTORY WORLD [DATA ZERO]` saves such a
checkpoint on the backend of `KERAS_BACKEND` (on torch, in `WORLD`
launched processes) and writes the record to `DIRECTORY/record.npz`.
"""

import os
import sys

import keras
import numpy as np

import keras_tp
from tests import models
from tests.models import loss_fn

STEPS = 4
BATCH = 8
NEXT_STEPS = 2
# Outputs of two layouts differ by float32 rounding of sums in other orders;
# on another backend the matmuls round differently too, and Adam's second
# update amplifies that (4e-5 seen from TensorFlow to JAX). A lost optimizer
# state moves the second loss by 1e-2 (`test_lost_optimizer_state_shows`).
OUTPUT_TOLERANCE = 1e-5
LOSS_TOLERANCE = 1e-5
CROSS_BACKEND_LOSS_TOLERANCE = 2e-4


def data(name):
    return models.data_for(name, batch=(STEPS + NEXT_STEPS) * BATCH, seed=3)


def compiled(model, name):
    """`model` compiled with the Adam the checkpoint runs use."""
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss_fn())
    return model


def parallel(name, world_size, data_parallel=1, zero_stage=0):
    tp = keras_tp.TensorParallelKeras(
        models.BUILDERS[name](),
        world_size=world_size,
        data_parallel=data_parallel,
        zero_stage=zero_stage,
    )
    return compiled(tp, name)


def train_and_save(model, name, directory):
    """Trains `STEPS` steps, saves, then records outputs and next losses.

    Returns:
        `{"outputs": predictions at the save, "losses": next steps' losses}`.
    """
    x, y = data(name)
    first = STEPS * BATCH
    model.fit(x[:first], y[:first], batch_size=BATCH, shuffle=False, verbose=0)
    keras_tp.save_checkpoint(model, directory, epoch=1)
    return record_after(model, name)


def record_after(model, name):
    """The predictions on the data and the losses of the next steps."""
    x, y = data(name)
    first = STEPS * BATCH
    outputs = model.predict(x[:BATCH], verbose=0)
    history = model.fit(
        x[first:],
        y[first:],
        batch_size=BATCH,
        epochs=NEXT_STEPS,
        steps_per_epoch=1,
        shuffle=False,
        verbose=0,
    )
    return {
        "outputs": np.asarray(outputs),
        "losses": np.asarray(history.history["loss"]),
    }


def load_and_record(model, name, directory):
    """Loads the checkpoint into `model` and records what it computes."""
    info = keras_tp.load_checkpoint(model, directory)
    assert info["epoch"] == 1, info
    assert info["step"] == STEPS, info
    return record_after(model, name)


def check_same(record, reference, what, loss_tolerance=LOSS_TOLERANCE):
    """Asserts that a loaded run computes what the saved one did.

    Returns:
        `(largest output difference, largest loss difference)`.
    """
    outputs = np.abs(record["outputs"] - reference["outputs"]).max()
    losses = np.abs(record["losses"] - reference["losses"]).max()
    assert outputs <= OUTPUT_TOLERANCE, (what, "outputs", outputs)
    assert losses <= loss_tolerance, (what, "losses", losses)
    return outputs, losses


def _save_on_rank(name, directory, world_size, data_parallel, zero_stage):
    tp = parallel(name, world_size, data_parallel, zero_stage)
    return train_and_save(tp, name, directory)


def main(directory, world_size, data_parallel=1, zero_stage=0, name=None):
    """Saves a checkpoint of `transformer_lm` and its record; see above."""
    name = name or "transformer_lm"
    if keras.backend.backend() != "torch":
        keras_tp.configure_virtual_devices(world_size)
    record = keras_tp.launch(
        _save_on_rank,
        world_size=world_size,
        args=(name, directory, world_size, data_parallel, zero_stage),
    )
    np.savez(os.path.join(directory, "record.npz"), **record)


if __name__ == "__main__":
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
