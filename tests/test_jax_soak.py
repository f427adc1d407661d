"""A long run on JAX: live arrays and host memory stay flat.

Run alone: `KERAS_BACKEND=jax python -m pytest tests/test_jax_soak.py`.
`benchmarks/soak.py` measures the 1,000-step run this test shortens.
"""

import os

import pytest

if os.environ.get("KERAS_BACKEND", "jax") != "jax":
    pytest.skip("JAX tests run with KERAS_BACKEND=jax", allow_module_level=True)
os.environ["KERAS_BACKEND"] = "jax"

import keras_tp  # noqa: E402

keras_tp.configure_virtual_devices(4)

from tests import soak_cases  # noqa: E402


def test_data_and_tensor_parallel_run_stays_flat():
    result = soak_cases.soak(
        soak_cases.TEST_STEPS,
        soak_cases.TEST_SAMPLE_EVERY,
        world_size=4,
        data_parallel=2,
    )
    soak_cases.check_flat(result["samples"])
