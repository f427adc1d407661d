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

import json
import os
import sys

import keras
import numpy as np

import keras_tp
from keras_tp.demo.models import transformer_lm
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


class _StopAtEpoch(keras.callbacks.Callback):
    """Ends training at the start of an epoch, as a crash would."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.epoch:
            raise KeyboardInterrupt(f"stopped at epoch {epoch}")


class _EpochLosses(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.losses = []

    def on_epoch_end(self, epoch, logs=None):
        self.losses.append(float(logs["loss"]))


def with_dropout(world_size, data_parallel=1, zero_stage=0):
    """A function of a seed making the transformer LM with dropout, split."""

    def make(seed):
        return keras_tp.TensorParallelKeras(
            # One block: the runs compile three models each.
            transformer_lm(seed=seed, blocks=1, dropout=DROPOUT),
            world_size=world_size,
            data_parallel=data_parallel,
            zero_stage=zero_stage,
        )

    return make


DROPOUT = 0.2
RESUME_EPOCHS = 4
RESUME_STOP = 2


def backup_and_restore_run(make_model, directory):
    """Losses of a run with dropout, uninterrupted and stopped and resumed.

    `keras.callbacks.BackupAndRestore` backs the model up each epoch (a
    sharded checkpoint, through `save_weights`); a run stopped at the start
    of epoch `RESUME_STOP` is resumed by a new model whose weights start
    elsewhere, which the callback restores.

    Args:
        make_model: function of a seed returning an uncompiled model.
        directory: where the runs back up.

    Returns:
        `(uninterrupted, resumed)`: the per-epoch losses of the whole run,
        and those of the resumed run (epochs `RESUME_STOP` on).
    """
    x, y = data("transformer_lm")

    def run(model, backup, *callbacks):
        losses = _EpochLosses()
        compiled(model, "transformer_lm").fit(
            x,
            y,
            batch_size=BATCH,
            epochs=RESUME_EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=[
                keras.callbacks.BackupAndRestore(backup),
                losses,
                *callbacks,
            ],
        )
        return losses.losses

    uninterrupted = run(make_model(0), os.path.join(directory, "whole"))
    backup = os.path.join(directory, "stopped")
    try:
        run(make_model(0), backup, _StopAtEpoch(RESUME_STOP))
    except KeyboardInterrupt:
        pass
    resumed = run(make_model(1), backup)
    return uninterrupted, resumed


def check_resumed(uninterrupted, resumed):
    """The resumed run's losses are the uninterrupted run's, exactly."""
    assert len(resumed) == RESUME_EPOCHS - RESUME_STOP, resumed
    np.testing.assert_allclose(
        resumed, uninterrupted[RESUME_STOP:], rtol=0, atol=LOSS_TOLERANCE
    )


def model_checkpoint_run(make_model, make_other, directory):
    """`ModelCheckpoint` saves each epoch; another layout loads the last.

    Args:
        make_model: function of a seed returning the model to train.
        make_other: the same, for the model that loads, at another layout.
        directory: where the checkpoints go.

    Returns:
        `(saved, loaded)`: the predictions of the trained model and of the
        model that loaded its last checkpoint.
    """
    x, y = data("transformer_lm")
    pattern = os.path.join(directory, "epoch{epoch}.weights.h5")
    model = compiled(make_model(0), "transformer_lm")
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[
            keras.callbacks.ModelCheckpoint(pattern, save_weights_only=True)
        ],
    )
    other = compiled(make_other(1), "transformer_lm")
    other.load_weights(pattern.format(epoch=2))
    return (
        model.predict(x[:BATCH], verbose=0),
        other.predict(x[:BATCH], verbose=0),
    )


def check_model_checkpoint(saved, loaded):
    np.testing.assert_allclose(loaded, saved, rtol=0, atol=OUTPUT_TOLERANCE)


def callbacks_on_rank(directory):
    """Both callback runs on two ranks; returns what the checks take."""
    resumed = backup_and_restore_run(
        with_dropout(2), os.path.join(directory, "backup")
    )
    checkpoints = model_checkpoint_run(
        with_dropout(2), with_dropout(2, 2, 1), os.path.join(directory, "each")
    )
    return resumed, checkpoints


def pipeline_round_trip(make_pipelined, directory, rank=0):
    """A pipelined MLP's checkpoint, loaded by a fresh pipeline and by a
    plain model on one device, computes what the saved pipeline did; a
    one-device checkpoint loads into the pipeline.

    Each stage's devices write their own variables' pieces. Runs on every
    rank on torch (where each rank holds one stage).

    Args:
        make_pipelined: function of a model returning it uncompiled in a
            `TensorParallelKeras` with `pipeline_parallel` > 1.
        directory: where the checkpoints go, the same on every rank.
        rank: this process's rank: each saves its own one-device model.

    Returns:
        `(largest output difference, largest loss difference)` of each
        load, and the saving manifest's files.
    """
    name = "mlp"
    saved_dir = os.path.join(directory, "pipelined")
    saved = train_and_save(
        compiled(make_pipelined(models.mlp()), name), name, saved_dir
    )
    differences = [
        check_same(
            load_and_record(
                compiled(make_pipelined(models.mlp(seed=1)), name),
                name,
                saved_dir,
            ),
            saved,
            "a pipeline loads a pipeline's checkpoint",
        ),
        check_same(
            load_and_record(
                compiled(models.mlp(seed=1), name), name, saved_dir
            ),
            saved,
            "one device loads a pipeline's checkpoint",
        ),
    ]
    plain_dir = os.path.join(directory, f"plain{rank}")
    plain = train_and_save(compiled(models.mlp(), name), name, plain_dir)
    differences.append(
        check_same(
            load_and_record(
                compiled(make_pipelined(models.mlp(seed=1)), name),
                name,
                plain_dir,
            ),
            plain,
            "a pipeline loads one device's checkpoint",
        )
    )
    with open(os.path.join(saved_dir, "manifest.json")) as file:
        manifest = json.load(file)
    return differences, manifest


def check_three_dimensional_round_trip(directory):
    """`pipeline_round_trip` at 2 replicas x 2 stages x 2-way tensor
    parallelism with ZeRO-1 on 8 devices: each device writes a file of
    its own, with its stage's shards and its ZeRO partition of their
    optimizer state.

    Args:
        directory: where the checkpoints go.
    """
    differences, manifest = pipeline_round_trip(
        lambda model: keras_tp.TensorParallelKeras(
            model,
            world_size=8,
            pipeline_parallel=2,
            data_parallel=2,
            zero_stage=1,
        ),
        directory,
    )
    assert manifest["mesh"]["pipeline_parallel"] == 2
    assert len(manifest["files"]) == 8
    assert len(differences) == 3


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


def loss_scale_round_trip(directory, save_layout, load_layouts):
    """A `mixed_float16` MLP trained at `save_layout` (`(world_size,
    data_parallel)`, `None` for one device), its loss scale set to 256,
    saved, and loaded at each of `load_layouts`: the loaded loss scales
    and the largest difference of the next steps' losses from the saved
    model's."""
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")

    def build(layout):
        model = models.mlp()
        if layout is not None:
            model = keras_tp.TensorParallelKeras(
                model, world_size=layout[0], data_parallel=layout[1]
            )
        return compiled(model, "mlp")

    try:
        saved = build(save_layout)
        x, y = data("mlp")
        first = STEPS * BATCH
        saved.fit(x[:first], y[:first], batch_size=BATCH, verbose=0)
        saved.optimizer.dynamic_scale.assign(256.0)
        keras_tp.save_checkpoint(saved, directory, epoch=1)
        reference = record_after(saved, "mlp")["losses"]
        scales, differences = [], []
        for layout in load_layouts:
            loaded = build(layout)
            keras_tp.load_checkpoint(loaded, directory)
            scale = keras.ops.convert_to_numpy(loaded.optimizer.dynamic_scale)
            scales.append(float(scale))
            losses = record_after(loaded, "mlp")["losses"]
            differences.append(float(np.abs(losses - reference).max()))
        return scales, differences
    finally:
        keras.mixed_precision.set_global_policy(policy)
