"""`mpirun -n 2 python train.py` on the torch backend, on loopback.

Run with `KERAS_BACKEND=torch python -m pytest tests/test_torch_mpi.py -q`
where Open MPI is installed (`apt-get install openmpi-bin`; `.ci/run` does
it). The mapping from MPI's variables to torchrun's is checked on
variables made up here; one mpirun job checks that ranks it starts train
like one device.
"""

import json

import keras
import pytest

if keras.backend.backend() != "torch":
    pytest.skip(
        "torch backend tests; run with KERAS_BACKEND=torch",
        allow_module_level=True,
    )

import numpy as np  # noqa: E402

from keras_tp import mpi  # noqa: E402
from tests import mpi_jobs  # noqa: E402
from tests.torch_scripts import train_smoke  # noqa: E402

OPEN_MPI_RANK_1 = {
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_SIZE": "4",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
    "PMIX_NAMESPACE": "915996673",
    "OMPI_MCA_ess_base_jobid": "915996673",
}
HYDRA_RANK_1 = {
    "PMI_RANK": "1",
    "PMI_SIZE": "2",
    "MPI_LOCALRANKID": "1",
    "MPI_LOCALNRANKS": "2",
}


def test_open_mpi_variables_become_torchrun_variables():
    variables = mpi.torchrun_variables(OPEN_MPI_RANK_1)
    port = int(variables.pop("MASTER_PORT"))
    assert variables == {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
    }
    assert 61000 <= port < 61000 + 4096
    # Every rank of the job derives the same port; another job another.
    rank_0 = {**OPEN_MPI_RANK_1, "OMPI_COMM_WORLD_RANK": "0"}
    assert mpi.torchrun_variables(rank_0)["MASTER_PORT"] == str(port)
    other_job = {**OPEN_MPI_RANK_1, "PMIX_NAMESPACE": "915996674"}
    assert mpi.torchrun_variables(other_job)["MASTER_PORT"] != str(port)


def test_hydra_variables_and_set_rendezvous():
    given = {**HYDRA_RANK_1, "MASTER_ADDR": "node0", "MASTER_PORT": "29500"}
    assert mpi.torchrun_variables(given) == {
        "RANK": "1",
        "WORLD_SIZE": "2",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "node0",
        "MASTER_PORT": "29500",
    }
    # Hydra names no job: on one host the port comes from the ranks'
    # parent, its proxy.
    assert mpi.torchrun_variables(HYDRA_RANK_1)["MASTER_PORT"].isdigit()
    assert mpi.mpi_rank({}) is None
    assert mpi.torchrun_variables({}) is None


def test_ranks_on_several_hosts_need_the_rendezvous():
    two_hosts = {**OPEN_MPI_RANK_1, "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    with pytest.raises(ValueError, match="MASTER_ADDR") as error:
        mpi.torchrun_variables(two_hosts)
    assert "mpirun -x MASTER_ADDR=$(hostname)" in str(error.value)
    given = {**two_hosts, "MASTER_ADDR": "node0"}
    assert mpi.torchrun_variables(given)["MASTER_ADDR"] == "node0"
    no_job = {**HYDRA_RANK_1, "MPI_LOCALNRANKS": "1", "MASTER_ADDR": "node0"}
    with pytest.raises(ValueError, match="MASTER_PORT"):
        mpi.torchrun_variables(no_job)


def test_mpirun_ranks_train_like_one_device(tmp_path):
    """2 ranks of `mpirun`, TP=2, with no torchrun variable set."""
    mpi_jobs.mpirun(
        2, "tests/torch_scripts/mpi_train.py", tmp_path, backend="torch"
    )
    ranks = [
        json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)
    ]
    one_device = train_smoke.train(mpi_jobs.mlp())
    for r, rank in enumerate(ranks):
        assert rank["launch_variables"] == []
        assert rank["elastic_world_size"] == 2
        assert (
            "world_size=4, but Open MPI's mpirun started 2 rank(s)"
            in (rank["refused"])
        )
        assert "OMPI_COMM_WORLD_SIZE=2" in rank["refused"]
        assert (rank["rank"], rank["mpi_rank"], rank["world_size"]) == (r, r, 2)
        assert rank["environment"]["RANK"] == str(r)
        assert rank["environment"]["LOCAL_RANK"] == str(r)
        assert rank["environment"]["MASTER_ADDR"] == "127.0.0.1"
        assert rank["info"]["tensor_parallel"] == 2
        np.testing.assert_allclose(rank["losses"], one_device, rtol=1e-5)
    assert ranks[0]["environment"] == {
        **ranks[1]["environment"],
        "RANK": "0",
        "LOCAL_RANK": "0",
    }
