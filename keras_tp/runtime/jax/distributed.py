"""How JAX processes started by `mpirun` become one job.

Each process of `mpirun -n 4 python train.py` calls
`jax.distributed.initialize`, which finds the job through `mpi4py` (JAX's
`cluster_detection_method="mpi4py"`): the number of processes, this one's
index, and rank 0's host, where the coordinator listens. The devices of
every process then form one list, `jax.devices()`, and a mesh over them
spans the job.
"""

import importlib.util
import logging

import jax

from keras_tp import mpi

logger = logging.getLogger(__name__)


def initialize_distributed():
    """Joins this process to the JAX job `mpirun` started, if it did.

    Does nothing if `jax.distributed` is already initialised, or if no MPI
    launcher started this process (one process, its own devices).

    Raises:
        ImportError: under `mpirun`, if `mpi4py` is not installed.
        RuntimeError: if JAX was initialised before (a JAX or Keras
            operation ran, or `keras_tp.configure_virtual_devices`).
    """
    if jax.distributed.is_initialized():
        return
    rank = mpi.mpi_rank()
    if rank is None:
        logger.info(
            "No MPI launcher started this process: JAX runs in one process "
            "on its own devices."
        )
        return
    if importlib.util.find_spec("mpi4py") is None:
        raise ImportError(
            f"This process is rank {rank.rank} of {rank.world_size} that "
            f"{rank.launcher} started, and JAX finds the other ranks through "
            'mpi4py, which is not installed: pip install "keras_tp[mpi]" '
            "(or pip install mpi4py) where the ranks run."
        )
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "keras_tp.initialize_distributed() must run before JAX "
            "initialises: call it right after `import keras_tp`, before "
            "keras_tp.configure_virtual_devices() and before any Keras or "
            "JAX operation."
        )
    jax.distributed.initialize(cluster_detection_method="mpi4py")
    # Not jax.process_index(): it would initialise JAX, and virtual
    # devices are configured after this call.
    logger.info(
        "JAX process %d of %d, started by %s.",
        rank.rank,
        rank.world_size,
        rank.launcher,
    )
