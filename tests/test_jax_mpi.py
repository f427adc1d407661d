"""`mpirun -n 2 python train.py` on the JAX backend, on loopback.

Run with `KERAS_BACKEND=jax python -m pytest tests/test_jax_mpi.py -q`
where Open MPI and mpi4py are installed (`apt-get install openmpi-bin`,
`pip install -e ".[mpi]"`; `.ci/run` does both). Two processes of two
virtual CPU devices each join one job with
`keras_tp.initialize_distributed()` and train tensor-parallel over the
four devices (tests/jax_scripts/mpi_train.py).
"""

import importlib.util
import json

import keras
import pytest

if keras.backend.backend() != "jax":
    pytest.skip(
        "JAX backend tests; run with KERAS_BACKEND=jax",
        allow_module_level=True,
    )

import jax  # noqa: E402

import keras_tp  # noqa: E402
from tests import mpi_jobs  # noqa: E402

ATOL = 1e-5
OPEN_MPI_RANK_0 = {
    "OMPI_COMM_WORLD_RANK": "0",
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_RANK": "0",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
}


def test_a_process_no_launcher_started_goes_on_alone():
    keras_tp.initialize_distributed()
    assert not jax.distributed.is_initialized()


def test_mpirun_without_mpi4py_says_how_to_install_it(monkeypatch):
    for name, value in OPEN_MPI_RANK_0.items():
        monkeypatch.setenv(name, value)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *args: (
            None if name == "mpi4py" else find_spec(name, *args)
        ),
    )
    with pytest.raises(ImportError, match="rank 0 of 2") as error:
        keras_tp.initialize_distributed()
    assert 'pip install "keras_tp[mpi]"' in str(error.value)
    assert not jax.distributed.is_initialized()


def test_mpirun_processes_train_like_one_device(tmp_path):
    """TP=4 over 2 processes of mpirun with 2 CPU devices each."""
    mpi_jobs.require(
        importlib.util.find_spec("mpi4py"), "mpi4py", mpi_jobs.INSTALL_MPI4PY
    )
    mpi_jobs.mpirun(
        2, "tests/jax_scripts/mpi_train.py", tmp_path, backend="jax"
    )
    for process in range(2):
        result = json.loads((tmp_path / f"process{process}.json").read_text())
        assert (result["process"], result["processes"]) == (process, 2)
        assert result["local_devices"] == 2
        assert len(result["devices"]) == 4  # 2 local + 2 remote devices
        assert result["weights"] <= ATOL
        # The consistency check compares the rows across the processes:
        # apart after a local step, equal after the synchronising one.
        assert result["consistency"] == [False, True]
