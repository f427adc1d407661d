"""The weights of `TensorParallelKeras` in and out: unsplit arrays and
sharded checkpoint directories, with the checks that name the fix."""

import os

from keras_tp import checkpoint


def set_full_weights(runtime, model, weights):
    """`TensorParallelKeras.set_weights()` (see there)."""
    variables = model.weights
    if len(weights) != len(variables):
        raise ValueError(
            f"set_weights() got {len(weights)} arrays but model "
            f"'{model.name}' has {len(variables)} weights."
        )
    for variable, value in zip(variables, weights):
        full_shape = runtime.placement.full_shapes[id(variable)]
        if tuple(value.shape) != full_shape:
            raise ValueError(
                f"set_weights(): variable '{variable.path}' has full "
                f"shape {full_shape}, got {tuple(value.shape)}."
            )
        runtime.assign_full_value(variable, value)


def save_weights(trainer, filepath, overwrite):
    """`TensorParallelKeras.save_weights()` (see there)."""
    filepath = os.fspath(filepath)
    if not overwrite and os.path.exists(filepath):
        raise FileExistsError(
            f"save_weights(): '{filepath}' exists and overwrite=False. "
            "Pass overwrite=True, or another path."
        )
    checkpoint.save_checkpoint(trainer, filepath)


def load_weights(trainer, filepath, skip_mismatch, kwargs):
    """`TensorParallelKeras.load_weights()` (see there)."""
    filepath = os.fspath(filepath)
    if skip_mismatch or kwargs:
        raise ValueError(
            "load_weights() of a TensorParallelKeras model takes only "
            f"the checkpoint path; got skip_mismatch={skip_mismatch} and "
            f"{sorted(kwargs)}."
        )
    if not os.path.isdir(filepath):
        raise ValueError(
            f"load_weights(): '{filepath}' is not a keras_tp checkpoint "
            "directory. Load a Keras weights file into the model before "
            "wrapping it (`model.load_weights(path)`, then "
            "`TensorParallelKeras(model, ...)`)."
        )
    checkpoint.load_checkpoint(trainer, filepath)
