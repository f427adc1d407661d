"""Ranks started by `mpirun`: who they are and where they meet.

`mpirun -n 4 python train.py` starts four processes and tells each its
place in the job through the launcher's own variables: Open MPI sets
`OMPI_COMM_WORLD_RANK`, `OMPI_COMM_WORLD_SIZE` and
`OMPI_COMM_WORLD_LOCAL_RANK`; MPICH's and Intel MPI's Hydra (`mpiexec`)
set `PMI_RANK`, `PMI_SIZE` and `MPI_LOCALRANKID`. `mpi_rank()` reads them;
`torchrun_variables()` turns them into the variables torchrun sets, which
is how a torch process joins its group. The JAX backend lets
`jax.distributed.initialize` find the same job through `mpi4py`
(`keras_tp.initialize_distributed()`).

A PMIx launcher that sets only `PMIX_RANK` (Slurm's `srun --mpi=pmix`)
does not say how many ranks there are; such a job sets `RANK` and
`WORLD_SIZE` itself, or runs under `torchrun`.

No backend is imported here.
"""

import collections
import os
import zlib

# Each launcher's variables: rank, world size, local rank, local world
# size (ranks on this host), in the order tried.
_LAUNCHERS = (
    (
        "Open MPI's mpirun",
        (
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "OMPI_COMM_WORLD_LOCAL_RANK",
            "OMPI_COMM_WORLD_LOCAL_SIZE",
        ),
    ),
    (
        "the PMI launcher (mpiexec, srun)",
        ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS"),
    ),
)
# The job's name, alike on every rank and different for every job: Open
# MPI's PMIx namespace or job id, or the PMI-2 job id of Slurm's `srun`.
_JOB_VARIABLES = ("PMIX_NAMESPACE", "OMPI_MCA_ess_base_jobid", "PMI_JOBID")
# Derived rendezvous ports lie above Linux's ephemeral range (32768-60999
# by default), where no outgoing connection takes them.
_FIRST_PORT = 61000
_PORTS = 4096

MpiRank = collections.namedtuple(
    "MpiRank",
    [
        "rank",
        "world_size",
        "local_rank",
        "local_world_size",
        "launcher",
        "size_variable",
        "job",
    ],
)
MpiRank.__doc__ = """This process' place in a job started by `mpirun`.

Attributes:
    rank: the rank of this process, `0` to `world_size - 1`.
    world_size: the number of ranks `mpirun` started.
    local_rank: the rank among the ranks on this host.
    local_world_size: the number of ranks on this host, or `None` if the
        launcher does not say.
    launcher: the launcher, in words: Open MPI's `mpirun`, or a PMI
        launcher (MPICH's or Intel MPI's `mpiexec`, Slurm's `srun`).
    size_variable: the variable the world size was read from.
    job: a name of the job, alike on every rank, or `None`.
"""


def mpi_rank(environ=None):
    """This process' rank in the job `mpirun` or `mpiexec` started.

    Args:
        environ: the variables to read; default: `os.environ`.

    Returns:
        An `MpiRank`, or `None` if no MPI launcher started this process.
    """
    environ = os.environ if environ is None else environ
    for launcher, names in _LAUNCHERS:
        rank, size, local_rank, local_size = names
        if rank in environ and size in environ:
            job = next(
                (environ[name] for name in _JOB_VARIABLES if name in environ),
                None,
            )
            return MpiRank(
                rank=int(environ[rank]),
                world_size=int(environ[size]),
                local_rank=int(environ.get(local_rank, 0)),
                local_world_size=(
                    int(environ[local_size]) if local_size in environ else None
                ),
                launcher=launcher,
                size_variable=size,
                job=job,
            )
    return None


def torchrun_variables(environ=None):
    """The variables torchrun would set, for a rank `mpirun` started.

    `RANK`, `WORLD_SIZE`, `LOCAL_RANK` and (if the launcher says)
    `LOCAL_WORLD_SIZE` come from the launcher. The rendezvous, where rank
    0 listens and the others connect, is `MASTER_ADDR:MASTER_PORT` if
    these are set; otherwise every rank derives the same one on its own,
    with no message passed:

    - the address is loopback when all ranks run on this host, and must
      be set (rank 0's host) when they span several;
    - the port is derived from the job's name (Open MPI's `PMIX_NAMESPACE`
      or `OMPI_MCA_ess_base_jobid`, Slurm's `PMI_JOBID`), a number from
      61000 to 65095 that is the same on every rank of a job and differs
      between jobs; Hydra names no job, so on one host the port is derived
      from the process that started the ranks (Hydra's proxy, the parent
      of every rank of the host); else `MASTER_PORT` must be set.

    Args:
        environ: the variables to read; default: `os.environ`.

    Returns:
        A dict of the torchrun variables, or `None` if no MPI launcher
        started this process.

    Raises:
        ValueError: if the ranks are not all on this host (or the
            launcher does not say) and `MASTER_ADDR` or `MASTER_PORT` is not
            set.
    """
    environ = os.environ if environ is None else environ
    rank = mpi_rank(environ)
    if rank is None:
        return None
    one_host = rank.local_world_size == rank.world_size
    address = environ.get("MASTER_ADDR") or ("127.0.0.1" if one_host else None)
    port = environ.get("MASTER_PORT")
    if port is None:
        # Hydra's proxy starts every rank of its host: their parent.
        job = rank.job or (f"parent {os.getppid()}" if one_host else None)
        port = None if job is None else str(_port_of(job))
    if address is None or port is None:
        raise ValueError(
            f"The {rank.world_size} ranks {rank.launcher} started are not "
            "all on this host, as far as its variables tell, so keras_tp "
            "cannot tell where rank 0 listens without MASTER_ADDR and "
            "MASTER_PORT. Set both on every rank, "
            "MASTER_ADDR to the host of rank 0 and MASTER_PORT to a free "
            "port there, e.g. `mpirun -x MASTER_ADDR=$(hostname) -x "
            "MASTER_PORT=29500 ...` (Open MPI) or `mpiexec -genv MASTER_ADDR "
            "$(hostname) -genv MASTER_PORT 29500 ...` (MPICH), run from the "
            "host of rank 0."
        )
    variables = {
        "RANK": str(rank.rank),
        "WORLD_SIZE": str(rank.world_size),
        "LOCAL_RANK": str(rank.local_rank),
        "MASTER_ADDR": address,
        "MASTER_PORT": port,
    }
    if rank.local_world_size is not None:
        variables["LOCAL_WORLD_SIZE"] = str(rank.local_world_size)
    return variables


def _port_of(job):
    # crc32, not hash(): Python salts str hashes differently per process.
    return _FIRST_PORT + zlib.crc32(job.encode()) % _PORTS
