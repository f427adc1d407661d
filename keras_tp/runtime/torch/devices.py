"""The devices of the torch runtime: one process per rank, in a group.

A process started by `keras_tp.launch` or `torchrun` joins the group its
`RANK`, `WORLD_SIZE` and `MASTER_*` variables describe, with the collective
timeout `KERAS_TP_COLLECTIVE_TIMEOUT` sets, and starts the heartbeat that
lets a failed collective name a lost rank (`liveness`). A process started
by `mpirun` gets these variables from the MPI launcher's (`keras_tp.mpi`).
The ranks form the runtime's `data x model` mesh, whose axes are process
groups (`mesh_groups`).
"""

import atexit
import datetime
import logging
import math
import os
import socket

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.constants import default_pg_timeout

from keras_tp import elastic
from keras_tp import mpi
from keras_tp.collectives.torch import TorchCollectiveAdapter
from keras_tp.runtime.base import median_seconds
from keras_tp.runtime.torch import liveness

logger = logging.getLogger(__name__)

_LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def configure_virtual_devices(n):
    """No-op on torch, where ranks are processes: logs how to start them."""
    logger.info(
        "On the torch backend each rank is a process, so there are no "
        "virtual devices to configure. Start %d ranks with "
        "`keras_tp.launch(train_fn, world_size=%d)` (notebooks, scripts) or "
        "`torchrun --nproc-per-node %d script.py`.",
        n,
        n,
        n,
    )


def join_ranks(world_size, caller=None, counted=""):
    """Joins this process's group (`join_process_group`) and checks that
    it has `world_size` ranks, one process each.

    Args:
        world_size: the number of ranks the caller needs; `None` for any.
        caller: what needs them, as the errors name it; by default
            `TensorParallelKeras(world_size=...)`.
        counted: how the caller counts them, for the error (a
            pipeline's ranks, say).

    Returns:
        The number of ranks of the group.
    """
    join_process_group(world_size, caller)
    ranks = dist.get_world_size()
    if world_size is not None and world_size != ranks:
        caller = caller or f"TensorParallelKeras(world_size={world_size})"
        raise ValueError(
            f"{caller} runs {world_size} ranks{counted}, but this process "
            f"group has {ranks} rank(s): on torch each rank is one process. "
            f"Start {world_size} (keras_tp.launch(fn, world_size="
            f"{world_size}) or torchrun --nproc-per-node {world_size}), or "
            f"ask for {ranks}."
        )
    return ranks


def join_process_group(world_size=None, caller=None):
    """Initialises the default process group of this process if needed.

    A process started by `keras_tp.launch` or `torchrun` joins its group
    from the `RANK`, `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`
    variables. A process started by `mpirun` (Open MPI) or `mpiexec`
    (MPICH, Intel MPI) without them first sets them, as torchrun would,
    from the launcher's variables (`keras_tp.mpi.torchrun_variables`), so
    that the code that reads them (`keras_tp.elastic_world_size()`, the
    user's own) sees a rank like any other. An un-launched process may
    only run one rank, in a group of its own. The group uses nccl for CUDA
    tensors and gloo for CPU ones.

    A collective of the group waits for the other ranks at most
    `KERAS_TP_COLLECTIVE_TIMEOUT` seconds, if set (`keras_tp.launch(...,
    collective_timeout=...)` sets it), else torch's default. Each rank of
    a multi-rank group records itself and a heartbeat in the rendezvous
    store, so that a collective that fails for a dead or frozen rank raises
    a `keras_tp.RankLostError` naming it (`keras_tp.runtime.torch.liveness`),
    also when the group was initialised by the caller.

    Args:
        world_size: the number of ranks the caller asks for, to explain
            the error when this process was not launched as a rank, or
            when `mpirun` started another number of ranks.
        caller: what needs the ranks, as the error names it; by default
            `TensorParallelKeras(world_size=...)`.

    Raises:
        ValueError: if `mpirun` started other than `world_size` ranks.
    """
    if dist.is_initialized():
        liveness.watch_ranks()
        return
    cuda = torch.cuda.is_available()
    backend = "cpu:gloo,cuda:nccl" if cuda else "gloo"
    if not all(name in os.environ for name in _LAUNCH_VARIABLES):
        _take_variables_from_mpi(world_size)
    if all(name in os.environ for name in _LAUNCH_VARIABLES):
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        _init_from_environment(backend)
    elif world_size in (None, 1):
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1
        )
    else:
        caller = caller or f"TensorParallelKeras(world_size={world_size})"
        raise RuntimeError(
            f"{caller} on the torch backend needs one process per rank, but "
            "this process was not started as a rank (no torch.distributed "
            "process group and no "
            f"{'/'.join(_LAUNCH_VARIABLES)} variables). From a notebook or a "
            f"script, run your training function with "
            f"`keras_tp.launch(train_fn, world_size={world_size})`; from a "
            f"shell, `torchrun --nproc-per-node {world_size} script.py` or "
            f"`mpirun -n {world_size} python script.py`."
        )
    atexit.register(_leave_process_group)
    liveness.watch_ranks()


def _take_variables_from_mpi(world_size):
    """Sets the torchrun variables of a rank `mpirun` started, if it is one.

    They go into this process' environment, as torchrun puts them in its
    ranks', because more than the rendezvous reads them: the liveness
    heartbeat, `keras_tp.elastic_world_size()` and training scripts.
    """
    rank = mpi.mpi_rank()
    if rank is None:
        return
    # Every rank checks before any waits for the others, so all fail alike
    # instead of waiting for ranks that do not exist.
    if world_size is not None and world_size != rank.world_size:
        raise ValueError(
            f"world_size={world_size}, but {rank.launcher} started "
            f"{rank.world_size} rank(s) ({rank.size_variable}="
            f"{rank.world_size}): on torch each rank is one process. Start "
            f"{world_size} ranks (`mpirun -n {world_size} python "
            f"script.py`) or pass world_size={rank.world_size} "
            "(`keras_tp.elastic_world_size()` reads it)."
        )
    variables = mpi.torchrun_variables()
    os.environ.update(variables)
    logger.info(
        "Rank %s of %s, started by %s: rendezvous at %s:%s.",
        variables["RANK"],
        variables["WORLD_SIZE"],
        rank.launcher,
        variables["MASTER_ADDR"],
        variables["MASTER_PORT"],
    )


def _init_from_environment(backend):
    """Joins the group that `RANK`, `WORLD_SIZE` and `MASTER_*` describe."""
    seconds = elastic.collective_timeout()
    timeout = datetime.timedelta(seconds=seconds) if seconds else None
    restart = elastic.restart_count()
    world_size = int(os.environ["WORLD_SIZE"])
    one_agent = os.environ.get("LOCAL_WORLD_SIZE") == str(world_size)
    if not (restart and one_agent and liveness.agent_store()):
        dist.init_process_group(backend, init_method="env://", timeout=timeout)
        return
    # torchrun keeps its store across restarts, and a restarted rank could
    # read the gloo address a rank of the previous attempt left there, and
    # fail to connect (pytorch#135712). One agent restarts all its ranks
    # together, so on one node the restart count names the attempt alike
    # on every rank: a key prefix of its own keeps attempts apart.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timeout or default_pg_timeout,
    )
    dist.init_process_group(
        backend,
        store=dist.PrefixStore(f"keras_tp/attempt{restart}/", store),
        rank=int(os.environ["RANK"]),
        world_size=world_size,
        timeout=timeout,
    )


def _leave_process_group():
    liveness.stop_watching()
    if dist.is_initialized():
        dist.destroy_process_group()


def rank_devices():
    """The device name of every rank of the process group, in rank order."""
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    return [f"{device_type}:{rank}" for rank in range(dist.get_world_size())]


def this_device():
    """The torch device this rank computes on."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def mesh_groups(shape, *axes):
    """This rank's process groups along axes of a mesh of all ranks.

    The ranks fill the mesh row-major, the last axis fastest: rank
    `d * P * T + p * T + t` sits at `(d, p, t)` of a `data x pipe x
    model` mesh of sizes `(D, P, T)`. The group along some axes holds the
    ranks that differ from this one in those axes only, ranked in mesh
    order (the group rank along one axis is the rank's index on it).

    Args:
        shape: `{axis name: size}` in the mesh's order; the sizes multiply
            to the number of ranks.
        *axes: for each group wanted, an axis name, or a tuple of names
            for a group along several axes.

    Returns:
        A list of this rank's groups, one per entry of `axes`; `None` (the
        default group) for one that holds every rank.

    Example:

    ```python
    # 8 ranks as 2 replicas x 2 stages x 2 tensor-parallel ranks.
    model, pipe, data = mesh_groups(
        {"data": 2, "pipe": 2, "model": 2}, "model", "pipe", "data"
    )
    ```
    """
    names = list(shape)
    grid = np.arange(math.prod(shape.values())).reshape(tuple(shape.values()))
    groups = []
    for spanned in axes:
        spanned = [spanned] if isinstance(spanned, str) else list(spanned)
        size = math.prod(shape[name] for name in spanned)
        if size == grid.size:
            groups.append(None)
            continue
        # One row per group: the other axes' indices first, the spanned
        # axes' last, in mesh order.
        order = [name for name in names if name not in spanned] + [
            name for name in names if name in spanned
        ]
        members = np.transpose(grid, [names.index(n) for n in order])
        # Every rank creates every group, in the same order, as
        # torch.distributed requires.
        group, _ = dist.new_subgroups_by_enumeration(
            members.reshape(-1, size).tolist()
        )
        groups.append(group)
    return groups


class ProcessDevices:
    """The `TorchRuntime`'s ranks, and the process groups of its axes."""

    def _available_devices(self):
        return rank_devices()

    def _axis_adapters(self):
        model_group, data_group, mesh_group = self._axis_groups()
        return (
            TorchCollectiveAdapter(model_group),
            TorchCollectiveAdapter(data_group, "data"),
            TorchCollectiveAdapter(mesh_group, ("data", "model")),
        )

    def _axis_groups(self):
        """This rank's process groups of the `model` axis, the `data` axis
        and the whole `data x model` mesh.

        Rank `r` sits at row `r // tensor_parallel` and column
        `r % tensor_parallel` of the mesh; a group of every rank is the
        default group (`None`).
        """
        model_group, data_group = mesh_groups(
            {"data": self.data_parallel, "model": self.tensor_parallel},
            "model",
            "data",
        )
        return model_group, data_group, None

    def time_data_all_reduce(self, nbytes, repeats):
        buffer = torch.zeros(nbytes // 4, device=self.device)
        group = self.data_adapter.group

        def all_reduce():
            dist.all_reduce(buffer, group=group)
            if buffer.is_cuda:
                torch.cuda.synchronize(buffer.device)

        seconds = median_seconds(all_reduce, repeats)
        # Every rank takes the slowest rank's time, so all choose alike.
        slowest = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        return float(slowest)

    def _rank_hosts(self):
        # torchrun numbers the nodes GROUP_RANK; a job set up by hand is
        # told apart by host name.
        host = os.environ.get("GROUP_RANK") or socket.gethostname()
        hosts = [None] * self.world_size
        dist.all_gather_object(hosts, host)
        return hosts

    def _level_adapters(self, within, across):
        model = self.tensor_parallel

        def adapter(groups):
            # Data rank d of shard m is global rank d * model + m; every
            # rank creates every group, as torch.distributed requires.
            enumeration = [
                [d * model + m for d in ranks]
                for m in range(model)
                for ranks in groups
            ]
            group, _ = dist.new_subgroups_by_enumeration(enumeration)
            return TorchCollectiveAdapter(group, "data")

        return adapter(within), adapter(across)
