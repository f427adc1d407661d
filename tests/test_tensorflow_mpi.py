"""`keras_tp.initialize_distributed()` on TensorFlow: no MPI jobs.

TensorFlow's workers find one another through `TF_CONFIG`; under `mpirun`
the call says so instead of running each process alone.
"""

import keras
import pytest

if keras.backend.backend() != "tensorflow":
    pytest.skip(
        "TensorFlow backend tests; run with KERAS_BACKEND=tensorflow",
        allow_module_level=True,
    )

import keras_tp  # noqa: E402


def test_alone_it_does_nothing_and_under_mpirun_it_points_to_tf_config(
    monkeypatch,
):
    keras_tp.initialize_distributed()
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "2")
    with pytest.raises(NotImplementedError, match="TF_CONFIG"):
        keras_tp.initialize_distributed()
