"""One rank of the JAX mpirun test (tests/test_jax_mpi.py).

    PYTHONPATH=. KERAS_BACKEND=jax mpirun -n 2 \
        python tests/jax_scripts/mpi_train.py OUT_DIR

Each of the 2 processes joins the job with `keras_tp.initialize_distributed()`
(mpi4py finds the others), makes 2 virtual CPU devices, and trains the MLP
tensor-parallel over all 4 devices next to the same model on one local
device; it writes what it saw and the largest weight difference to
`OUT_DIR/process<i>.json`, then whether 2 data-parallel rows, one per
process, agree after each of 2 steps of local SGD.
"""

import json
import os
import sys

import keras_tp

keras_tp.initialize_distributed()
keras_tp.configure_virtual_devices(2)

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from tests import models  # noqa: E402
from tests import mpi_jobs  # noqa: E402


def main(out_dir):
    x, y = models.data_for("mlp", batch=16)
    reference = mpi_jobs.mlp()
    tp = keras_tp.TensorParallelKeras(
        mpi_jobs.mlp(), world_size=keras_tp.elastic_world_size()
    )
    for model in (reference, tp):
        model.compile(
            optimizer=keras.optimizers.SGD(0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    result = {
        "tensorflow_imported": "tensorflow" in sys.modules,
        "process": jax.process_index(),
        "processes": jax.process_count(),
        "local_devices": len(jax.local_devices()),
        "devices": tp.get_parallelism_info()["devices"],
        "weights": max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(tp.get_weights(), reference.get_weights())
        ),
    }
    result["consistency"] = _local_sgd_consistency(x, y)
    path = os.path.join(out_dir, f"process{jax.process_index()}.json")
    with open(path, "w") as f:
        json.dump(result, f)


def _local_sgd_consistency(x, y):
    """`check_gradient_consistency()` after each of 2 steps of local SGD
    (`local_sgd_steps=2`) on 2 data-parallel rows, one per process: the
    rows differ after the first, local step, and agree after the second,
    which averages them."""
    tp = keras_tp.TensorParallelKeras(
        mpi_jobs.mlp(), world_size=4, data_parallel=2
    )
    tp.compile(
        optimizer=keras_tp.CoordinatedOptimizer(
            keras.optimizers.SGD(0.1), local_sgd_steps=2
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    consistent = []
    for step in range(2):
        batch = slice(8 * step, 8 * (step + 1))
        tp.train_on_batch(x[batch], y[batch])
        consistent.append(tp.check_gradient_consistency()["consistent"])
    return consistent


if __name__ == "__main__":
    main(sys.argv[1])
