"""How JAX processes started by `mpirun` or Ray Train become one job.

Each process of `mpirun -n 4 python train.py` calls
`jax.distributed.initialize`, which finds the job through `mpi4py` (JAX's
`cluster_detection_method="mpi4py"`): the number of processes, this one's
index, and rank 0's host, where the coordinator listens. The workers of
Ray Train's `JaxTrainer` learn their ranks from Ray's context and the
coordinator's address from worker 0, through Ray Train's own broadcast
(on GPUs and TPUs `JaxTrainer` joins them itself). The devices of every
process then form one list, `jax.devices()`, and a mesh over them spans
the job.
"""

import importlib.util
import logging
import socket
import sys

import jax

from keras_tp import mpi

logger = logging.getLogger(__name__)


def initialize_distributed():
    """Joins this process to the JAX job `mpirun` or Ray Train started.

    Does nothing if `jax.distributed` is already initialised, or if no MPI
    launcher or Ray trainer started this process (one process, its own
    devices).

    Raises:
        ImportError: under `mpirun`, if `mpi4py` is not installed.
        RuntimeError: if JAX was initialised before (a JAX or Keras
            operation ran, or `keras_tp.configure_virtual_devices`).
    """
    if jax.distributed.is_initialized():
        return
    context = _ray_train_context()
    if context is not None:
        _check_not_started()
        _join_ray_workers(context)
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
    _check_not_started()
    jax.distributed.initialize(cluster_detection_method="mpi4py")
    # Not jax.process_index(): it would initialise JAX, and virtual
    # devices are configured after this call.
    logger.info(
        "JAX process %d of %d, started by %s.",
        rank.rank,
        rank.world_size,
        rank.launcher,
    )


def _check_not_started():
    # Private: JAX has no public way to ask without starting its backends.
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        raise RuntimeError(
            "keras_tp.initialize_distributed() must run before JAX "
            "initialises: call it right after `import keras_tp`, before "
            "keras_tp.configure_virtual_devices() and before any Keras or "
            "JAX operation."
        )


def _ray_train_context():
    """Ray Train's context where this process is a Ray Train worker (Ray
    is then imported already), else `None`."""
    if "ray.train" not in sys.modules:
        return None
    import ray.train

    try:
        return ray.train.get_context()
    except RuntimeError:
        return None


def _join_ray_workers(context):
    """Starts `jax.distributed` over Ray Train's workers: worker 0's host
    runs the coordinator, on a free port it broadcasts to the others."""
    import ray
    from ray.train import collective

    address = None
    if context.get_world_rank() == 0:
        host = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((host, 0))
            address = f"{host}:{probe.getsockname()[1]}"
    address = collective.broadcast_from_rank_zero(address)
    jax.distributed.initialize(
        address, context.get_world_size(), context.get_world_rank()
    )
    logger.info(
        "JAX process %d of %d, a worker of Ray Train.",
        context.get_world_rank(),
        context.get_world_size(),
    )
