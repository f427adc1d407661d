"""`launch`: run a training function on every rank, from a notebook or script.

On the torch backend each rank is a process: `launch` runs them under
`torch.distributed.elastic`'s agent, as torchrun does (forked from a server
that imported keras once, with the agent's rendezvous on loopback), and
brings rank 0's result (or a rank's exception) back to the caller. With
`max_restarts`, a job that loses ranks starts again on the ranks that are
left, as torchrun's elastic agent does when a node leaves. JAX and
TensorFlow put ranks on devices of one process, so there `launch` simply
calls the function: one notebook cell works on every backend.
"""

import contextlib
import functools
import logging
import os
import pickle
import signal
import tempfile
import time
import uuid
import warnings

import keras

from keras_tp import elastic
from keras_tp import rank_processes
from keras_tp.errors import AttemptFailed
from keras_tp.errors import RankError
from keras_tp.errors import RankLostError
from keras_tp.errors import RankStuckError
from keras_tp.errors import RankTimeoutError
from keras_tp.errors import RemoteTraceback
from keras_tp.errors import check_count

# The errors `launch` raises are importable from here, as they were before
# they moved to `keras_tp.errors`.
__all__ = [
    "RankError",
    "RankLostError",
    "RankStuckError",
    "RankTimeoutError",
    "RemoteTraceback",
    "launch",
    "usable_cores",
]

logger = logging.getLogger(__name__)


def launch(
    train_fn,
    world_size=2,
    args=(),
    kwargs=None,
    timeout=3600.0,
    master_addr="127.0.0.1",
    master_port=None,
    threads_per_rank=None,
    max_restarts=0,
    min_world_size=1,
    allowed_world_sizes=None,
    collective_timeout=None,
    nproc_per_node=None,
):
    """Runs `train_fn(*args, **kwargs)` on `world_size` ranks.

    On the torch backend, each rank is a fresh process that
    `torch.distributed.elastic`'s agent starts (forkserver) and
    supervises, with the caller's environment and `RANK`, `LOCAL_RANK`,
    `WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT` set as torchrun sets
    them, so `keras_tp.TensorParallelKeras(model, world_size=world_size)`
    inside `train_fn` joins the process group. On GPUs rank `r` uses
    `cuda:r`. `train_fn` may be defined in a script's `__main__` (guard the
    script's top level with `if __name__ == "__main__":`) or in a notebook
    cell: it is sent to the ranks by value with cloudpickle.

    Each rank's torch computes with `threads_per_rank` CPU threads
    (`OMP_NUM_THREADS` in the rank). By default the cores this process may
    use are shared among the ranks: torch would otherwise start a thread
    per core in every rank, and ranks that each take every core slow one
    another down (torchrun sets one thread per rank for the same reason).
    With fewer cores than CPU ranks, `launch` warns that the ranks take
    turns on the cores.

    **Elastic restarts.** With `max_restarts > 0`, a failed job starts
    again, from `train_fn`'s beginning, in fresh processes, as torchrun's
    elastic agent restarts its workers; `train_fn` resumes from its last
    checkpoint. A rank whose process ended without an exception (killed,
    crashed, `os._exit`), or that a surviving rank's `RankLostError` names
    (it stopped responding), is *lost*: the next attempt runs on the ranks
    that are left, or on the largest of `allowed_world_sizes` that is not
    more, as torchrun shrinks a job when a node leaves. A rank that raised
    an exception is not lost: the job restarts at the same size.
    `keras_tp.elastic_world_size()` and `keras_tp.restart_count()` tell
    `train_fn` where it is, as `WORLD_SIZE` and
    `TORCHELASTIC_RESTART_COUNT` do under torchrun.

    **Collective timeout.** `collective_timeout` sets
    `KERAS_TP_COLLECTIVE_TIMEOUT` in the ranks: a collective that waits
    longer for another rank fails, and the surviving ranks raise a
    `RankLostError` that names the lost rank instead of hanging. When
    every rank is alive but some never entered the collective (a hung data
    loader, a deadlock), the error is a `RankStuckError` naming them, with
    the last collective each entered and its Python stack; stuck ranks are
    not lost, so a restart keeps the job's size.

    On the JAX and TensorFlow backends ranks are devices of this process,
    so `train_fn` is simply called here.

    Args:
        train_fn: the function every rank runs.
        world_size: number of ranks (processes) to start.
        args: positional arguments for `train_fn`.
        kwargs: keyword arguments for `train_fn`.
        timeout: seconds after which ranks still running are stopped and a
            `RankTimeoutError` names them, with the stack each was in
            (each attempt has its own `timeout`).
        master_addr: address of the rendezvous; loopback by default.
        master_port: its port; a free one by default (a new one for each
            attempt).
        threads_per_rank: CPU threads of each rank's torch; default:
            `$OMP_NUM_THREADS` if set, else the usable cores divided by
            the number of ranks, at least 1.
        max_restarts: how many times a failed job starts again before
            `launch` raises the failure (torchrun's `--max-restarts`).
        min_world_size: the fewest ranks a restart may run on (torchrun's
            `--nnodes=MIN:MAX`, counted in ranks).
        allowed_world_sizes: the sizes a restart may run on, for models
            whose split needs a divisor (heads, features, `data_parallel`
            x `tensor_parallel`); default: any size from `min_world_size`
            to `world_size`.
        collective_timeout: seconds a collective waits for the other ranks
            before it fails; default: `$KERAS_TP_COLLECTIVE_TIMEOUT` if set,
            else torch's default (30 minutes for gloo).
        nproc_per_node: ranks per node, numbered as torchrun numbers the
            ranks of `--nnodes` nodes (`GROUP_RANK`, `LOCAL_RANK`,
            `LOCAL_WORLD_SIZE`); default: all on one node. Several nodes
            on this machine are for testing what depends on the node
            layout, such as `CoordinatedOptimizer(hierarchical=True)`;
            CPU ranks only.

    Returns:
        What `train_fn` returned on rank 0 (of the last attempt).

    Raises:
        Exception: the exception a rank raised, re-raised here with the
            rank's traceback as its cause.
        RankError: if a rank died without an exception, or a restart would
            have fewer ranks than `min_world_size` allows.
        RankLostError: if a collective failed because a rank stopped
            responding; it names the rank.
        RankStuckError: if a collective timed out because live ranks
            never entered it; it names them and shows their stacks.
        RankTimeoutError: if ranks were still running after `timeout`.

    Example:

    ```python
    def train(epochs):
        model = build_my_keras_model()
        tp = keras_tp.TensorParallelKeras(model, world_size=2)
        tp.compile(optimizer="adam", loss="mse")
        return tp.fit(x, y, epochs=epochs).history

    history = keras_tp.launch(train, world_size=2, args=(3,))
    ```
    """
    kwargs = kwargs or {}
    if keras.backend.backend() != "torch":
        return train_fn(*args, **kwargs)
    sizes = _restart_sizes(
        world_size, max_restarts, min_world_size, allowed_world_sizes
    )
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if 0 < gpus < world_size:
        raise ValueError(
            f"launch(world_size={world_size}) gives each rank its own GPU, "
            f"but {gpus} are visible. Start at most {gpus} ranks, or hide "
            "the GPUs (CUDA_VISIBLE_DEVICES='') to run CPU ranks over gloo."
        )
    if nproc_per_node is not None:
        check_count("nproc_per_node", nproc_per_node)
    if gpus and nproc_per_node is not None:
        raise ValueError(
            f"launch(nproc_per_node={nproc_per_node}) lays out several nodes "
            "on this machine, whose ranks would share cuda:LOCAL_RANK. Run "
            "torchrun on each node instead, or hide the GPUs "
            "(CUDA_VISIBLE_DEVICES='') to run CPU ranks."
        )
    environment = {
        "KERAS_BACKEND": "torch",
        # As torchrun's agent sets them, so `train_fn` reads them alike.
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
    }
    if collective_timeout is not None:
        environment[elastic.COLLECTIVE_TIMEOUT_VARIABLE] = str(
            elastic.check_collective_timeout(collective_timeout)
        )
    payload = _pickle_by_value((train_fn, args, kwargs))
    # Every attempt starts its ranks alike, but for their number.
    attempt = functools.partial(
        _run_attempt,
        payload,
        environment,
        timeout,
        (master_addr, master_port),
        threads_per_rank,
    )
    restart = 0
    while True:
        environment["TORCHELASTIC_RESTART_COUNT"] = str(restart)
        try:
            return attempt(world_size, nproc_per_node or world_size)
        except AttemptFailed as failure:
            next_size = _next_world_size(sizes, world_size - len(failure.lost))
            if restart == max_restarts or next_size is None:
                if restart < max_restarts:
                    failure.error.add_note(
                        f"keras_tp.launch did not restart: "
                        f"{_restart_refusal(world_size, failure.lost, sizes)}"
                    )
                raise failure.error from failure.cause
            restart += 1
            logger.warning(
                "keras_tp.launch: %s. Restarting on %d rank(s) (restart %d "
                "of %d); train_fn resumes from its last checkpoint.",
                failure.summary,
                next_size,
                restart,
                max_restarts,
            )
            world_size = next_size


def _restart_sizes(world_size, max_restarts, min_world_size, sizes):
    """The world sizes a restart may choose from, checked."""
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}.")
    if not 1 <= min_world_size <= world_size:
        raise ValueError(
            f"min_world_size={min_world_size} must be between 1 and "
            f"world_size={world_size}."
        )
    if sizes is None:
        return list(range(min_world_size, world_size + 1))
    sizes = sorted(set(sizes))
    if world_size not in sizes:
        raise ValueError(
            f"allowed_world_sizes={sizes} must contain the world_size the "
            f"job starts with, {world_size}."
        )
    return [size for size in sizes if size >= min_world_size]


def _next_world_size(sizes, ranks_left):
    """The largest allowed size the ranks left can run, or `None`."""
    return max((size for size in sizes if size <= ranks_left), default=None)


def _restart_refusal(world_size, lost, sizes):
    left = world_size - len(lost)
    return (
        f"{len(lost)} of {world_size} ranks were lost and {left} are left, "
        f"fewer than every allowed world size ({sizes}). Lower "
        "min_world_size or allow smaller sizes (allowed_world_sizes)."
    )


def _run_attempt(
    payload,
    environment,
    timeout,
    rendezvous,
    threads_per_rank,
    world_size,
    nproc_per_node,
):
    """Runs one attempt of the job under `torch.distributed.elastic`'s
    agent, which starts and supervises the ranks and hosts their
    rendezvous; returns rank 0's result.

    `rendezvous` is `(master_addr, master_port)`, the port `None` for a
    free one. The agent restarts nothing: `launch` decides on which ranks
    a failed job starts again, where one agent would restart its node's
    ranks at their number.

    Raises:
        AttemptFailed: if a rank failed; the other ranks were stopped.
        RankTimeoutError: if ranks were still running after `timeout`.
    """
    from torch.distributed.elastic.multiprocessing.errors import (
        ChildFailedError,
    )
    from torch.distributed.launcher.api import LaunchConfig
    from torch.distributed.launcher.api import elastic_launch

    cores = usable_cores()
    threads = (
        threads_per_rank
        or os.environ.get("OMP_NUM_THREADS")
        or max(1, cores // world_size)
    )
    if not _has_gpus() and cores < world_size:
        warnings.warn(
            f"keras_tp.launch: {world_size} ranks share {cores} CPU cores, "
            "so they take turns on them and every step waits for the "
            f"slowest rank. Each rank computes with {threads} thread(s); "
            f"start at most {cores} ranks for speed.",
            stacklevel=3,
        )
    master_addr, master_port = rendezvous
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=world_size,
        run_id=f"keras_tp_{uuid.uuid4().hex}",
        rdzv_backend="c10d",
        rdzv_endpoint=f"{master_addr}:{master_port or 0}",
        max_restarts=0,
        start_method="forkserver",
        shutdown_timeout=rank_processes.GRACE_SECONDS,
    )
    rank_environment = {
        **os.environ,
        **environment,
        "OMP_NUM_THREADS": str(threads),
    }
    with tempfile.TemporaryDirectory(prefix="keras_tp_launch_") as workdir:
        _start_forkserver()
        start = time.monotonic()
        try:
            with _signal_handlers_kept(), _agent_logs_quiet():
                results = elastic_launch(config, rank_processes.run_rank)(
                    nproc_per_node, payload, workdir, rank_environment, timeout
                )
        except ChildFailedError as failed:
            raise rank_processes.failure(
                failed.failures,
                workdir,
                world_size,
                timeout,
                time.monotonic() - start,
            ) from None
    return results[0]


def _start_forkserver():
    """Starts the process that the ranks are forked from, once.

    Importing keras and torch takes a rank about 8 s of CPU; the fork
    server imports them once, and every rank of every later `launch` of
    this process starts from its copy. Where TensorFlow is installed it
    imports it too: Keras does in every rank that seeds
    (`keras.utils.set_random_seed` seeds TensorFlow's generator) or reads
    a `tf.data` input, 3 s of CPU each. It runs no torch or TensorFlow
    code, so it holds no threads, process group or device.
    """
    import importlib.util
    import multiprocessing.forkserver as forkserver

    modules = list(rank_processes.RANK_MODULES)
    if importlib.util.find_spec("tensorflow") is not None:
        modules.append("tensorflow")
    # Only the first call starts the server: later ones find it running.
    forkserver.set_forkserver_preload(modules)
    with _environment(KERAS_BACKEND="torch"):
        forkserver.ensure_running()


def _has_gpus():
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _pickle_by_value(obj):
    """Pickles `obj`, sending functions of `__main__` by value.

    A notebook's `__main__` cannot be imported by the ranks, so its
    functions travel as code (cloudpickle).
    """
    try:
        import cloudpickle
    except ImportError:
        return pickle.dumps(obj)
    return cloudpickle.dumps(obj)


def usable_cores():
    """The number of CPU cores this process may run on.

    Its CPU affinity where the platform reports one, else every core.
    """
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@contextlib.contextmanager
def _agent_logs_quiet():
    """Keeps the agent's logs of failed ranks out of the caller's output:
    `launch` raises the rank's own exception, with its traceback."""
    loggers = [
        logging.getLogger(name)
        for name in ("torch.distributed.elastic", "torch.multiprocessing")
    ]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@contextlib.contextmanager
def _signal_handlers_kept():
    """Restores the handlers of the signals the agent handles (a
    notebook's Ctrl-C) once it has run."""
    names = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT")
    kept = {
        number: signal.getsignal(number)
        for number in (getattr(signal, name, None) for name in names)
        if number is not None
    }
    try:
        yield
    finally:
        for number, handler in kept.items():
            if handler is not None:
                signal.signal(number, handler)


@contextlib.contextmanager
def _environment(**variables):
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
