"""A `tf.data.Dataset` read by shares, on any Keras backend.

A `tf.data` batch cannot be read in part: `shared_dataset` keeps this
row's slice of each global batch (`Dataset.map`), so only the slice is
converted for the backend, but each process still runs the whole
pipeline.
"""

import tensorflow as tf


def is_shared(dataset):
    """Whether `dataset` is already one row's share (`shared_dataset`)."""
    return getattr(dataset, "_keras_tp_row_share", False)


def shared_dataset(dataset, row, rows):
    """Row `row`'s slice of each global batch of a `tf.data.Dataset`."""

    def share(tensor):
        # A batch size known statically (`drop_remainder=True`) keeps the
        # share's static shape.
        size = tensor.shape[0]
        if size is not None:
            _check_static(size, rows)
            share_size = size // rows
            return tensor[row * share_size : (row + 1) * share_size]
        size = tf.shape(tensor)[0]
        tf.debugging.assert_equal(
            size % rows,
            0,
            message=_uneven(rows),
        )
        share_size = size // rows
        return tensor[row * share_size : (row + 1) * share_size]

    shared = dataset.map(
        lambda *batch: tf.nest.map_structure(
            share, batch if len(batch) > 1 else batch[0]
        ),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    shared._keras_tp_row_share = True
    return shared


def _uneven(rows):
    return (
        f"A batch of a tf.data.Dataset cannot be shared evenly by "
        f"data_parallel={rows} rows: batch the dataset with a batch "
        f"size that divides by {rows}, and drop_remainder=True or "
        "a number of samples that the batch size divides."
    )


def _check_static(size, rows):
    if size % rows:
        raise ValueError(_uneven(rows))
