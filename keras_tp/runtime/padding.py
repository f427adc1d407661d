"""`predict()` and `evaluate()` on any number of samples, with a data axis.

Each data rank takes an equal slice of a global batch, so a batch whose
size does not divide by `data_parallel` (the last batch of an epoch, most
often) cannot be split as it is. Training refuses it, since the padding
would change the gradients; predicting and evaluating pad it: the last
row is repeated up to the next multiple (a real row, so that no padded
row computes a NaN), each data rank runs the model on its slice, and the
outputs, put back together, lose the padded rows. `predict` returns them;
`evaluate` computes the loss and the metrics once, on the real rows of
the global batch, as TensorFlow's steps always do: they are exactly those
of one device, for every metric (Keras' `metrics=` take no sample
weight, so zero weights could not hide padded rows from them).

This module works on the static shapes of torch's eager steps and of
JAX's traced ones; TensorFlow's steps, whose batch size may be unknown
when traced, pad with TensorFlow's ops (`runtime/tensorflow/steps.py`).
"""

import keras
import numpy as np
from keras import ops


def batch_size(data):
    """The size of the first batched array of `data`, or `None`."""
    for leaf in keras.tree.flatten(data):
        shape = getattr(leaf, "shape", None)
        if shape is not None and len(shape) and shape[0] is not None:
            return int(shape[0])
    return None


def rows_to_add(data, data_parallel):
    """How many rows make `data`'s batch divide by `data_parallel`."""
    size = batch_size(data)
    if data_parallel == 1 or not size:
        return 0
    return -size % data_parallel


def padded(data, extra):
    """Every batched array of `data` with its last row repeated `extra`
    times."""

    def pad(leaf):
        if isinstance(leaf, np.ndarray):
            leaf = ops.convert_to_tensor(leaf)
        if not _batched(leaf):
            return leaf
        return ops.concatenate(
            [leaf, ops.repeat(leaf[-1:], extra, axis=0)], axis=0
        )

    return keras.tree.map_structure(pad, data)


def dropped(outputs, size):
    """Every batched output with only its first `size` rows."""
    return keras.tree.map_structure(
        lambda y: y[:size] if _batched(y) else y, outputs
    )


def _batched(leaf):
    shape = getattr(leaf, "shape", None)
    return shape is not None and len(shape) > 0
