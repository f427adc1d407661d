"""The slices of a global batch that the workers take, one at a time."""

import dataclasses

import keras
import numpy as np


@dataclasses.dataclass
class Slice:
    """One worker's share of one global batch.

    Attributes:
        batch: the index of the global batch in the epoch.
        x: the inputs (the structure the model takes).
        y: the targets, or `None`.
        sample_weight: the sample weights, or `None`.
        samples: the number of samples.
    """

    batch: int
    x: object
    y: object
    sample_weight: object
    samples: int


def as_arrays(x, y, sample_weight):
    """NumPy versions of `fit`'s data, checked to have one length.

    Raises:
        TypeError: for data that is not arrays (a dataset, a generator).
        ValueError: for arrays of different lengths.
    """
    names = ("x", "y", "sample_weight")
    arrays = [
        None if value is None else _as_array(name, value)
        for name, value in zip(names, (x, y, sample_weight))
    ]
    lengths = {
        len(leaf)
        for value in arrays
        if value is not None
        for leaf in keras.tree.flatten(value)
    }
    if len(lengths) != 1:
        raise ValueError(
            "AsyncDataParallel.fit(): x, y and sample_weight must have the "
            f"same number of samples; got lengths {sorted(lengths)}."
        )
    return arrays


def _as_array(name, value):
    """`value` (an array or a structure of them) as NumPy arrays.

    `np.asarray` of a dataset or a generator succeeds too, as a 0-d object
    array: a leaf without a sample axis is what tells them apart.
    """
    try:
        arrays = keras.tree.map_structure(np.asarray, value)
    except Exception:
        arrays = None
    if arrays is None or any(
        leaf.ndim == 0 for leaf in keras.tree.flatten(arrays)
    ):
        raise TypeError(
            f"AsyncDataParallel.fit() takes {name} as arrays (NumPy or "
            "backend tensors, or a list or dict of them); got "
            f"{type(value).__name__}. Read a dataset into arrays first: for "
            "a batched tf.data.Dataset of (x, y) pairs, `x, y = "
            "(np.concatenate(part) for part in "
            "zip(*dataset.as_numpy_iterator()))`, then fit(x, y, "
            "batch_size=...)."
        )
    return arrays


def epoch_slices(x, y, sample_weight, batch_size, workers, order):
    """Cuts one epoch into global batches and each batch into slices.

    Batch `b` holds the samples `order[b * batch_size:(b + 1) *
    batch_size]`, and is cut into `workers` slices as even as possible,
    as data parallelism gives each replica its part of the batch.

    Args:
        x, y, sample_weight: NumPy arrays (or structures of them).
        batch_size: samples per global batch.
        workers: slices per batch.
        order: the order of the samples in this epoch.

    Returns:
        The list of non-empty `Slice`s, batch by batch.
    """
    slices = []
    for batch, start in enumerate(range(0, len(order), batch_size)):
        indices = order[start : start + batch_size]
        for part in np.array_split(indices, workers):
            if len(part) == 0:
                continue

            def take(value, part=part):
                if value is None:
                    return None
                return keras.tree.map_structure(lambda a: a[part], value)

            slices.append(
                Slice(batch, take(x), take(y), take(sample_weight), len(part))
            )
    return slices
