"""A training script for `mpirun`: the README's user code, sized by MPI.

    PYTHONPATH=. KERAS_BACKEND=torch mpirun -n 2 \
        python tests/torch_scripts/mpi_train.py OUT_DIR

No torchrun variables are set: each rank learns its place from Open MPI's.
It first asks for 4 ranks (refused), then trains `mpi_jobs.mlp()` as
`train_smoke.py` does, with `world_size=keras_tp.elastic_world_size()`, and
writes what it saw to `OUT_DIR/rank<r>.json`; tests/test_torch_mpi.py
compares the losses with the same model trained on one device.
"""

import json
import os
import sys

import torch.distributed as dist

import keras_tp
from tests import mpi_jobs
from tests.torch_scripts import train_smoke

if __name__ == "__main__":
    seen = {
        "launch_variables": sorted(
            name
            for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
            if name in os.environ
        ),
        "elastic_world_size": keras_tp.elastic_world_size(),
    }
    try:
        keras_tp.TensorParallelKeras(mpi_jobs.mlp(), world_size=4)
    except ValueError as error:
        seen["refused"] = str(error)
    tp = keras_tp.TensorParallelKeras(
        mpi_jobs.mlp(), world_size=keras_tp.elastic_world_size()
    )
    seen["losses"] = train_smoke.train(tp)
    seen["rank"] = dist.get_rank()
    seen["world_size"] = dist.get_world_size()
    seen["environment"] = {
        name: os.environ[name]
        for name in ("RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    seen["mpi_rank"] = int(os.environ["OMPI_COMM_WORLD_RANK"])
    seen["info"] = tp.get_parallelism_info()
    seen["tensorflow_imported"] = "tensorflow" in sys.modules
    path = os.path.join(sys.argv[1], f"rank{seen['rank']}.json")
    with open(path, "w") as f:
        json.dump(seen, f)
