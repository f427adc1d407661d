"""Gradient compression over the data axis on PyTorch (2 processes, gloo).

Run alone: `KERAS_BACKEND=torch python -m pytest
tests/test_torch_compression.py`. One launch runs every check on each
rank (`compression_cases.rank_checks`): exact bytes per kind, bf16/fp16
close to uncompressed, the compression state through a checkpoint.
"""

import keras
import pytest

if keras.backend.backend() != "torch":
    pytest.skip(
        "torch backend tests; run with KERAS_BACKEND=torch",
        allow_module_level=True,
    )

from keras_tp.launcher import launch  # noqa: E402
from tests import compression_cases as cases  # noqa: E402
from tests.torch_scripts import compression_checks  # noqa: E402

LAYOUTS = {
    "bf16": [(2, 2, 2)],
    "fp16": [(2, 2, 0)],
    "powersgd": [(2, 2, 0)],
    "sign": [(2, 2, 0)],
}


def test_every_check_passes_on_every_rank(tmp_path):
    ranks = launch(
        compression_checks.checks,
        world_size=2,
        args=(LAYOUTS, str(tmp_path)),
        timeout=400,
    )
    assert [rank["runs"] for rank in ranks] == [6, 6]
    for rank in ranks:
        cases.check_zero3_message(rank["zero3"])
    # Both ranks log the global batch's losses.
    assert ranks[0]["resumed"] == ranks[1]["resumed"]
