"""Each data-parallel row reads only its share of each global batch (torch).

Run alone:
`KERAS_BACKEND=torch python -m pytest tests/test_torch_data_shares.py`.
One launch of 2 processes (data_parallel=2) runs `tests/share_cases.py`;
the datasets count what each process reads, and every run is checked
against one device trained on the same global batches.
"""

import keras
import pytest

if keras.backend.backend() != "torch":
    pytest.skip(
        "torch backend tests; run with KERAS_BACKEND=torch",
        allow_module_level=True,
    )

from keras_tp.launcher import launch  # noqa: E402
from tests import share_cases  # noqa: E402
from tests.torch_scripts import share_checks  # noqa: E402


@pytest.fixture(scope="module")
def processes():
    return launch(share_checks.shares, world_size=2, timeout=300)


def test_a_dataloader_is_read_once_per_epoch_across_the_rows(processes):
    share_cases.check_dataloader_reads(processes)


def test_a_shuffled_dataloader_is_shuffled_alike_on_every_process(processes):
    share_cases.check_shuffled_alike(processes)


def test_shares_train_evaluate_and_predict_as_one_device(processes):
    share_cases.check_as_one_device(processes)


def test_tf_data_and_py_dataset_train_as_one_device(processes):
    share_cases.check_tf_data_and_py_dataset(processes)


def test_an_indivisible_batch_names_the_sizes_and_the_fix(processes):
    share_cases.check_indivisible_batches(processes)
