"""Run on every rank by `keras_tp.launch` in tests/test_torch_data_shares.py.

Each process reads its data-parallel row's share of each global batch.
The datasets count the samples they read themselves; the oracle is the
same model on one device, trained in the same process on the same global
batches.
"""

import os
import random

import keras
import numpy as np
import tensorflow as tf
import torch

import keras_tp
from tests import models
from tests.torch_scripts.rank_checks import _all_ranks

SAMPLES = 32
BATCH = 8  # the global batch: 4 samples a row


class CountingDataset(torch.utils.data.Dataset):
    """`(x[i], y[i])`, recording every index `__getitem__` reads."""

    def __init__(self, x, y):
        self.x, self.y = x, y
        self.read = []

    def __len__(self):
        return len(self.x)

    def __getitem__(self, index):
        self.read.append(int(index))
        return self.x[index], self.y[index]


class CountingPyDataset(keras.utils.PyDataset):
    """Batches of `BATCH` samples, recording every batch read."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y = x, y
        self.read = []

    def __len__(self):
        return len(self.x) // BATCH

    def __getitem__(self, index):
        self.read.append(int(index))
        rows = slice(index * BATCH, (index + 1) * BATCH)
        return self.x[rows], self.y[rows]


def _pair():
    """A one-device model and its 2-row data-parallel copy, compiled alike."""
    reference = models.mlp()
    tp = keras_tp.TensorParallelKeras(
        models.mlp(), world_size=2, data_parallel=2
    )
    for model in (reference, tp):
        model.compile(
            optimizer=keras.optimizers.SGD(0.1), loss=models.loss_fn()
        )
    return reference, tp


def _loader(dataset, **options):
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, **options)


def shares():
    """Samples read per process, and losses against one device."""
    # Processes seeded apart: a shuffle must still be alike everywhere.
    torch.manual_seed(int(os.environ["RANK"]))
    x, y = models.data_for("mlp", batch=SAMPLES)
    result = {}

    reference, tp = _pair()
    data = CountingDataset(x, y)
    history = tp.fit(
        _loader(data),
        validation_data=_loader(CountingDataset(x, y)),
        epochs=1,
        verbose=0,
    )
    one_device_data = CountingDataset(x, y)
    expected = reference.fit(
        _loader(one_device_data), validation_data=(x, y), epochs=1, verbose=0
    )
    result["fit_reads"] = data.read
    result["one_device_fit_reads"] = one_device_data.read
    result["losses"] = [history.history["loss"], expected.history["loss"]]
    result["val_losses"] = [
        history.history["val_loss"],
        expected.history["val_loss"],
    ]
    result["weights"] = models.max_diff(
        reference.get_weights(), tp.get_weights()
    )
    data = CountingDataset(x, y)
    predictions = tp.predict(_loader(data), verbose=0)
    result["predict_reads"] = data.read
    result["predictions"] = float(
        np.max(np.abs(predictions - reference.predict(x, verbose=0)))
    )
    result["evaluate"] = [
        tp.evaluate(_loader(CountingDataset(x, y)), verbose=0),
        reference.evaluate(x, y, batch_size=BATCH, verbose=0),
    ]

    shuffled = CountingDataset(x, y)
    tp.fit(_loader(shuffled, shuffle=True), epochs=2, verbose=0)
    result["shuffled_reads"] = shuffled.read

    reference, tp = _pair()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    result["tf_data_losses"] = [
        tp.fit(dataset, epochs=1, verbose=0).history["loss"],
        reference.fit(dataset, epochs=1, verbose=0).history["loss"],
    ]

    reference, tp = _pair()
    batches = CountingPyDataset(x, y)
    result["py_dataset_losses"] = [
        tp.fit(batches, epochs=1, shuffle=False, verbose=0).history["loss"],
        reference.fit(
            CountingPyDataset(x, y), epochs=1, shuffle=False, verbose=0
        ).history["loss"],
    ]
    # Python's `random`, which Keras shuffles a PyDataset's batches with,
    # seeded apart: the processes still read the same batches.
    random.seed(int(os.environ["RANK"]))
    batches.read = []
    tp.fit(batches, epochs=2, verbose=0)
    result["py_dataset_reads"] = batches.read

    odd = _loader(CountingDataset(x[:29], y[:29]))
    try:
        tp.fit(odd, verbose=0)
    except ValueError as error:
        result["indivisible"] = str(error)
    per_process = CountingDataset(x, y)
    try:
        tp.fit(
            _loader(
                per_process,
                sampler=torch.utils.data.DistributedSampler(per_process),
            ),
            verbose=0,
        )
    except ValueError as error:
        result["distributed_sampler"] = str(error)
    reference.set_weights(tp.get_weights())
    predictions = tp.predict(odd, verbose=0)
    result["odd_predictions"] = [
        len(predictions),
        models.max_diff([predictions], [reference.predict(x[:29], verbose=0)]),
    ]
    return _all_ranks(result)
