"""Each data-parallel row of a job reads only its share of every batch.

`shares` runs in every process of a job of 2 data-parallel rows, one row's
devices in each process (torch ranks, JAX processes); the `check_*`
functions check all of their results. The datasets count the samples
they read themselves; the oracle is the same model on one device,
trained in the same process on the same global batches.
"""

import random

import keras
import numpy as np
import tensorflow as tf
import torch

import keras_tp
from tests import models

TOLERANCE = 1e-5
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


def _pair(wrap):
    """A one-device model and its 2-row data-parallel copy, compiled alike."""
    reference = models.mlp()
    tp = keras_tp.TensorParallelKeras(models.mlp(), **wrap)
    for model in (reference, tp):
        model.compile(
            optimizer=keras.optimizers.SGD(0.1), loss=models.loss_fn()
        )
    return reference, tp


def _loader(dataset, **options):
    return torch.utils.data.DataLoader(dataset, batch_size=BATCH, **options)


def shares(process, **wrap):
    """Samples read per process, and losses against one device.

    Args:
        process: this process's index in the job.
        **wrap: the `TensorParallelKeras` arguments of the job, with
            `data_parallel=2` and one row's devices in each process.

    Returns:
        Plain numbers and lists, for the `check_*` functions.
    """
    # Processes seeded apart: a shuffle must still be alike everywhere.
    torch.manual_seed(process)
    x, y = models.data_for("mlp", batch=SAMPLES)
    result = {}

    reference, tp = _pair(wrap)
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

    reference, tp = _pair(wrap)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    result["tf_data_losses"] = [
        tp.fit(dataset, epochs=1, verbose=0).history["loss"],
        reference.fit(dataset, epochs=1, verbose=0).history["loss"],
    ]

    reference, tp = _pair(wrap)
    batches = CountingPyDataset(x, y)
    result["py_dataset_losses"] = [
        tp.fit(batches, epochs=1, shuffle=False, verbose=0).history["loss"],
        reference.fit(
            CountingPyDataset(x, y), epochs=1, shuffle=False, verbose=0
        ).history["loss"],
    ]
    # Python's `random`, which Keras shuffles a PyDataset's batches with,
    # seeded apart: the processes still read the same batches.
    random.seed(process)
    batches.read = []
    tp.fit(batches, epochs=2, verbose=0)
    result["py_dataset_reads"] = batches.read

    odd = _loader(CountingDataset(x[:29], y[:29]))
    try:
        tp.fit(odd, verbose=0)
    except ValueError as error:
        result["indivisible"] = str(error)
    per_process = CountingDataset(x, y)
    # Told its place, as JAX's processes have no torch process group.
    sampler = torch.utils.data.DistributedSampler(
        per_process, num_replicas=2, rank=process
    )
    try:
        tp.fit(_loader(per_process, sampler=sampler), verbose=0)
    except ValueError as error:
        result["distributed_sampler"] = str(error)
    reference.set_weights(tp.get_weights())
    predictions = tp.predict(odd, verbose=0)
    result["odd_predictions"] = [
        len(predictions),
        models.max_diff([predictions], [reference.predict(x[:29], verbose=0)]),
    ]
    return result


def _close(pair):
    distributed, one_device = pair
    return max(abs(a - b) for a, b in zip(distributed, one_device))


def _shares(reads, row):
    """Row `row`'s half of each global batch of `reads`, in order."""
    half = BATCH // 2
    return [
        index
        for start in range(0, len(reads), BATCH)
        for index in reads[start : start + BATCH][row * half : (row + 1) * half]
    ]


def check_dataloader_reads(processes):
    """Each row read its share of every batch, once per epoch."""
    # Keras reads the first batch once more before the first step, to
    # build the model: on one device too.
    one_device = processes[0]["one_device_fit_reads"]
    assert len(one_device) == SAMPLES + BATCH
    reads = [p["fit_reads"] for p in processes]
    for row, read in enumerate(reads):
        assert read == _shares(one_device, row)
    assert sorted(reads[0] + reads[1]) == sorted(one_device)
    predicted = [p["predict_reads"] for p in processes]
    assert sorted(predicted[0] + predicted[1]) == list(range(SAMPLES))


def check_shuffled_alike(processes):
    """A shuffled DataLoader was shuffled alike on every process."""
    reads = [p["shuffled_reads"] for p in processes]
    half = SAMPLES // 2
    for epoch in range(2):
        epoch_reads = [r[epoch * half : (epoch + 1) * half] for r in reads]
        assert len(epoch_reads[0]) == len(epoch_reads[1]) == half
        assert sorted(epoch_reads[0] + epoch_reads[1]) == list(range(SAMPLES))
    # The processes were seeded apart, and the epochs were shuffled.
    assert reads[0][:half] != processes[0]["fit_reads"]
    assert reads[0][:half] != reads[0][half:]


def check_as_one_device(processes):
    """Shares train, evaluate and predict as one device does."""
    for process in processes:
        assert _close(process["losses"]) < TOLERANCE
        assert _close(process["val_losses"]) < TOLERANCE
        assert process["weights"] < TOLERANCE
        assert process["predictions"] < TOLERANCE
        distributed, one_device = process["evaluate"]
        assert abs(distributed - one_device) < TOLERANCE


def check_tf_data_and_py_dataset(processes):
    """A tf.data.Dataset and a PyDataset train as one device does."""
    for process in processes:
        assert _close(process["tf_data_losses"]) < TOLERANCE
        assert _close(process["py_dataset_losses"]) < TOLERANCE
    # A PyDataset's batches are read whole by every process, in the same
    # shuffled order.
    reads = [p["py_dataset_reads"] for p in processes]
    assert reads[0] == reads[1]
    batches = list(range(SAMPLES // BATCH))
    assert sorted(reads[0]) == sorted(batches + batches)
    assert reads[0] != batches + batches


def check_indivisible_batches(processes):
    """An indivisible batch is named with the sizes and the fix."""
    # predict() reads such a loader whole and pads the last batch.
    size, difference = processes[0]["odd_predictions"]
    assert size == 29 and difference < TOLERANCE
    message = processes[0]["indivisible"]
    assert "A batch of 5 samples" in message
    assert "data_parallel=2" in message
    assert "drop_last=True" in message
    message = processes[0]["distributed_sampler"]
    assert "DistributedSampler" in message
    assert "Give every process the same DataLoader" in message
