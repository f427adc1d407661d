"""`launch`: run a training function on every rank, from a notebook or script.

On the torch backend each rank is a process: `launch` spawns them with
`torch.multiprocessing`, points them at a rendezvous on loopback, and
brings rank 0's result (or a rank's exception) back to the caller. With
`max_restarts`, a job that loses ranks starts again on the ranks that are
left, as torchrun's elastic agent does when a node leaves. JAX and
TensorFlow put ranks on devices of one process, so there `launch` simply
calls the function: one notebook cell works on every backend.
"""

import contextlib
import faulthandler
import logging
import multiprocessing.connection
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
import warnings

import keras

from keras_tp import elastic

logger = logging.getLogger(__name__)

# Seconds a rank has to write its stack after a timeout, and to exit after
# another rank failed.
_GRACE_SECONDS = 3.0


class RankError(RuntimeError):
    """A rank failed; the message says which and how.

    Raised when a rank's exception cannot be re-raised as itself (it does
    not pickle), when a rank dies without an exception, or, as a
    `RankTimeoutError`, when ranks outlive the timeout.
    """


class RankTimeoutError(RankError, TimeoutError):
    """Ranks were still running when `launch`'s timeout expired."""


class RankLostError(RankError):
    """A collective failed because other ranks died or stopped responding.

    Raised on a surviving rank, in place of the backend's own error (a
    gloo "Connection reset by peer" or "Timed out waiting", a TensorFlow
    `UnavailableError`), which is its `__cause__`. Under `keras_tp.launch`
    it comes back to the caller; under `torchrun` it is the error the
    rank's traceback ends with.

    Attributes:
        ranks: the ranks (torch) or workers (TensorFlow) that were lost.
        rank: the rank or worker that raised.
    """

    def __init__(self, message, ranks=(), rank=None):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.rank = rank

    def __reduce__(self):
        # Pickled from a rank to the caller of `launch`.
        return type(self), (self.args[0], self.ranks, self.rank)


class RemoteTraceback(Exception):
    """The traceback of an exception raised on another rank, as text."""

    def __str__(self):
        return self.args[0]


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
):
    """Runs `train_fn(*args, **kwargs)` on `world_size` ranks.

    On the torch backend, each rank is a fresh process started with
    `torch.multiprocessing` (spawn), with `RANK`, `LOCAL_RANK`,
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
    `RankLostError` that names the lost rank instead of hanging.

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

    Returns:
        What `train_fn` returned on rank 0 (of the last attempt).

    Raises:
        Exception: the exception a rank raised, re-raised here with the
            rank's traceback as its cause.
        RankError: if a rank died without an exception, or a restart would
            have fewer ranks than `min_world_size` allows.
        RankLostError: if a collective failed because a rank stopped
            responding; it names the rank.
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
    restart = 0
    while True:
        environment["TORCHELASTIC_RESTART_COUNT"] = str(restart)
        try:
            return _run_attempt(
                payload,
                world_size,
                environment,
                timeout,
                master_addr,
                master_port,
                threads_per_rank,
            )
        except _AttemptFailed as failure:
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


class _AttemptFailed(Exception):
    """An attempt's ranks failed: what to raise, and which ranks were lost.

    Attributes:
        error: the exception `launch` raises if it does not restart.
        cause: its `__cause__` (the rank's traceback, as text).
        lost: the ranks that are gone (died, or named by a survivor).
        summary: one line saying what happened, for the restart's log.
    """

    def __init__(self, error, cause, lost, summary):
        super().__init__(summary)
        self.error = error
        self.cause = cause
        self.lost = frozenset(lost)
        self.summary = summary


def _run_attempt(
    payload,
    world_size,
    environment,
    timeout,
    master_addr,
    master_port,
    threads_per_rank,
):
    """Runs one attempt of the job; returns rank 0's result.

    Raises:
        _AttemptFailed: if a rank failed; the other ranks were stopped.
        RankTimeoutError: if ranks were still running after `timeout`.
    """
    import torch.multiprocessing as mp

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
    port = master_port or _free_port(master_addr)
    with tempfile.TemporaryDirectory(prefix="keras_tp_launch_") as workdir:
        # Ranks import keras (through keras_tp) and torch before anything
        # else runs: they must start with this process' backend and with
        # their share of the cores.
        with _environment(OMP_NUM_THREADS=str(threads), **environment):
            context = mp.start_processes(
                _run_rank,
                args=(world_size, master_addr, port, payload, workdir),
                nprocs=world_size,
                join=False,
                start_method="spawn",
            )
        try:
            _wait(context.processes, timeout, workdir)
        finally:
            # Also on an interrupt of the caller (Ctrl-C in a notebook).
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join()
        try:
            with open(os.path.join(workdir, "result.pkl"), "rb") as f:
                return pickle.load(f)
        except FileNotFoundError:
            raise RankError(
                "Rank 0 exited without returning from train_fn (did it call "
                "sys.exit?)."
            ) from None


def _has_gpus():
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def _run_rank(rank, world_size, master_addr, master_port, payload, workdir):
    """The body of one rank's process (top level, so spawn can import it)."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    import torch
    import torch.distributed as dist

    from keras_tp.collectives.torch import TorchCollectiveAdapter
    from keras_tp.runtime import torch_liveness

    if torch.cuda.is_available():
        torch.cuda.set_device(rank)
    with open(_stack_path(workdir, rank), "w") as stack_file:
        # On timeout the parent sends SIGUSR1 to learn where each rank is.
        faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=True)
        try:
            train_fn, args, kwargs = pickle.loads(payload)
            # `keras_tp.collectives` functions work anywhere in the rank.
            with TorchCollectiveAdapter().activated():
                result = train_fn(*args, **kwargs)
            if rank == 0:
                with open(os.path.join(workdir, "result.pkl"), "wb") as f:
                    pickle.dump(result, f)
        except Exception as e:
            # A collective that failed for a lost rank says which rank.
            lost = torch_liveness.rank_lost_error(e)
            if lost is None:
                _write_error(workdir, rank, e)
                raise
            lost.__cause__ = e
            _write_error(workdir, rank, lost)
            raise lost from e
        finally:
            torch_liveness.stop_watching()
            if dist.is_initialized():
                dist.destroy_process_group()


def _wait(processes, timeout, workdir):
    """Waits for the ranks; returns when every rank finished.

    On the first failure, the other ranks get `_GRACE_SECONDS` to end by
    themselves (they usually raise about the lost rank, which names it),
    then are stopped.

    Raises:
        _AttemptFailed: if a rank failed.
        RankTimeoutError: if ranks were still running after `timeout`.
    """
    deadline = time.monotonic() + timeout
    while True:
        failed = [r for r, p in enumerate(processes) if p.exitcode]
        running = [p for p in processes if p.exitcode is None]
        if failed or not running:
            break
        left = deadline - time.monotonic()
        if left <= 0:
            _stop_on_timeout(processes, timeout, workdir)
        multiprocessing.connection.wait(
            [p.sentinel for p in running], timeout=min(1.0, left)
        )
    if not failed:
        return
    _join_all(processes, _GRACE_SECONDS)
    stopped = [r for r, p in enumerate(processes) if p.is_alive()]
    for rank in stopped:
        processes[rank].terminate()
    _join_all(processes, _GRACE_SECONDS)
    for rank in stopped:
        if processes[rank].is_alive():
            processes[rank].kill()
        processes[rank].join()
    raise _failure(processes, failed, stopped, workdir)


def _join_all(processes, seconds):
    deadline = time.monotonic() + seconds
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))


def _failure(processes, first_failed, stopped, workdir):
    """The `_AttemptFailed` of an attempt whose ranks `first_failed` failed.

    A rank that ended without an exception (killed, crashed, `os._exit`)
    before `launch` stopped anyone is lost, and is the cause; otherwise the
    first exception raised is.
    """
    errors = _read_errors(workdir, len(processes))
    died = [
        r
        for r, p in enumerate(processes)
        if r not in stopped and r not in errors and p.exitcode
    ]
    named = set()
    for blob, _, _ in errors.values():
        error = pickle.loads(blob) if blob is not None else None
        if isinstance(error, RankLostError):
            named.update(error.ranks)
    lost = set(died) | named
    silent = [r for r in first_failed if r in died]
    if silent or not errors:
        rank = (silent or died or first_failed)[0]
        process = processes[rank]
        how = _describe_exit(process.exitcode)
        error = RankError(
            f"Rank {rank} (pid {process.pid}) died without raising an "
            f"exception: process {rank} terminated with {how}. The other "
            "ranks were stopped."
        )
        return _AttemptFailed(error, None, lost, f"rank {rank} died ({how})")
    rank = min(errors, key=lambda r: errors[r][2])
    blob, text, _ = errors[rank]
    cause = RemoteTraceback(f"\n\nRank {rank}: {text}")
    if blob is None:
        error = RankError(f"Rank {rank} failed:\n\nRank {rank}: {text}")
        cause = None
    else:
        error = pickle.loads(blob)
        error.add_note(f"(raised on rank {rank} of keras_tp.launch)")
    if lost:
        summary = f"rank(s) {sorted(lost)} lost ({type(error).__name__})"
    else:
        summary = f"rank {rank} raised {type(error).__name__}: {error}"
    return _AttemptFailed(error, cause, lost, summary)


def _describe_exit(exitcode):
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


def _stop_on_timeout(processes, timeout, workdir):
    running = [r for r, p in enumerate(processes) if p.is_alive()]
    for rank in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(processes[rank].pid, signal.SIGUSR1)
    time.sleep(_GRACE_SECONDS)
    for rank in running:
        processes[rank].kill()
        processes[rank].join()
    stacks = []
    for rank in running:
        with open(_stack_path(workdir, rank)) as f:
            stacks.append(f"-- Rank {rank} was at:\n{f.read().strip()}")
    finished = sorted(set(range(len(processes))) - set(running))
    raise RankTimeoutError(
        f"keras_tp.launch timed out after {timeout} s: rank(s) "
        f"{', '.join(map(str, running))} still running and were stopped "
        f"(finished: {finished or 'none'}). A rank waiting in a collective "
        "is usually waiting for a rank that is elsewhere.\n\n"
        + "\n\n".join(stacks)
    )


def _write_error(workdir, rank, error):
    text = "".join(traceback.format_exception(error))
    try:
        blob = pickle.dumps(error)
        pickle.loads(blob)
    except Exception:
        blob = None
    with open(_error_path(workdir, rank), "wb") as f:
        pickle.dump((blob, text, time.time()), f)


def _read_errors(workdir, world_size):
    """`{rank: (pickled exception or None, traceback text, time)}`."""
    errors = {}
    for rank in range(world_size):
        path = _error_path(workdir, rank)
        if os.path.exists(path):
            with open(path, "rb") as f:
                errors[rank] = pickle.load(f)
    return errors


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


def _free_port(address):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((address, 0))
        return s.getsockname()[1]


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


def _stack_path(workdir, rank):
    return os.path.join(workdir, f"stack_rank{rank}.txt")


def _error_path(workdir, rank):
    return os.path.join(workdir, f"error_rank{rank}.pkl")
