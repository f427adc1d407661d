"""A long run on torch: every rank's tensors and host memory stay flat.

Run alone: `KERAS_BACKEND=torch python -m pytest tests/test_torch_soak.py`.
Two ranks over gloo, data parallel (the `CoordinatedOptimizer`'s buckets,
hooks and timeline); `benchmarks/soak.py` measures the 1,000-step runs
this test shortens.
"""

import keras
import pytest

if keras.backend.backend() != "torch":
    pytest.skip(
        "torch backend tests; run with KERAS_BACKEND=torch",
        allow_module_level=True,
    )

from keras_tp.launcher import launch  # noqa: E402
from tests import soak_cases  # noqa: E402

LAUNCH_TIMEOUT = 300


def test_data_parallel_run_stays_flat_on_every_rank():
    ranks = launch(
        soak_cases.soak_on_every_rank,
        world_size=2,
        args=(soak_cases.TEST_STEPS, soak_cases.TEST_SAMPLE_EVERY, 2, 2),
        timeout=LAUNCH_TIMEOUT,
    )
    assert len(ranks) == 2
    for result in ranks:
        soak_cases.check_flat(result["samples"])
