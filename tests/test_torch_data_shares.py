"""Each data-parallel row reads only its share of each global batch (torch).

Run alone:
`KERAS_BACKEND=torch python -m pytest tests/test_torch_data_shares.py`.
One launch of 2 processes (data_parallel=2); the datasets count what each
process reads, and every run is checked against one device trained on the
same global batches.
"""

import keras
import pytest

if keras.backend.backend() != "torch":
    pytest.skip(
        "torch backend tests; run with KERAS_BACKEND=torch",
        allow_module_level=True,
    )

from keras_tp.launcher import launch  # noqa: E402
from tests.torch_scripts import share_checks  # noqa: E402
from tests.torch_scripts.share_checks import BATCH  # noqa: E402
from tests.torch_scripts.share_checks import SAMPLES  # noqa: E402

TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def processes():
    return launch(share_checks.shares, world_size=2, timeout=300)


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


def test_a_dataloader_is_read_once_per_epoch_across_the_rows(processes):
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


def test_a_shuffled_dataloader_is_shuffled_alike_on_every_process(processes):
    reads = [p["shuffled_reads"] for p in processes]
    half = SAMPLES // 2
    for epoch in range(2):
        epoch_reads = [r[epoch * half : (epoch + 1) * half] for r in reads]
        assert len(epoch_reads[0]) == len(epoch_reads[1]) == half
        assert sorted(epoch_reads[0] + epoch_reads[1]) == list(range(SAMPLES))
    # The processes were seeded apart, and the epochs were shuffled.
    assert reads[0][:half] != processes[0]["fit_reads"]
    assert reads[0][:half] != reads[0][half:]


def test_shares_train_evaluate_and_predict_as_one_device(processes):
    for process in processes:
        assert _close(process["losses"]) < TOLERANCE
        assert _close(process["val_losses"]) < TOLERANCE
        assert process["weights"] < TOLERANCE
        assert process["predictions"] < TOLERANCE
        distributed, one_device = process["evaluate"]
        assert abs(distributed - one_device) < TOLERANCE


def test_tf_data_and_py_dataset_train_as_one_device(processes):
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


def test_an_indivisible_batch_names_the_sizes_and_the_fix(processes):
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
