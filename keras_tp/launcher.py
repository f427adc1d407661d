"""`launch`: run a training function on every rank, from a notebook or script.

On the torch backend each rank is a process: `launch` spawns them with
`torch.multiprocessing`, points them at a rendezvous on loopback, and
brings rank 0's result (or a rank's exception) back to the caller. JAX and
TensorFlow put ranks on devices of one process, so there `launch` simply
calls the function: one notebook cell works on every backend.
"""

import contextlib
import faulthandler
import os
import pickle
import signal
import socket
import tempfile
import time
import traceback
import warnings

import keras

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

    On the JAX and TensorFlow backends ranks are devices of this process,
    so `train_fn` is simply called here.

    Args:
        train_fn: the function every rank runs.
        world_size: number of ranks (processes) to start.
        args: positional arguments for `train_fn`.
        kwargs: keyword arguments for `train_fn`.
        timeout: seconds after which ranks still running are stopped and a
            `RankTimeoutError` names them, with the stack each was in.
        master_addr: address of the rendezvous; loopback by default.
        master_port: its port; a free one by default.
        threads_per_rank: CPU threads of each rank's torch; default:
            `$OMP_NUM_THREADS` if set, else the usable cores divided by
            `world_size`, at least 1.

    Returns:
        What `train_fn` returned on rank 0.

    Raises:
        Exception: the exception a rank raised, re-raised here with the
            rank's traceback as its cause.
        RankError: if a rank died without an exception.
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
    import torch
    import torch.multiprocessing as mp

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if 0 < gpus < world_size:
        raise ValueError(
            f"launch(world_size={world_size}) gives each rank its own GPU, "
            f"but {gpus} are visible. Start at most {gpus} ranks, or hide "
            "the GPUs (CUDA_VISIBLE_DEVICES='') to run CPU ranks over gloo."
        )
    cores = usable_cores()
    threads = (
        threads_per_rank
        or os.environ.get("OMP_NUM_THREADS")
        or max(1, cores // world_size)
    )
    if not gpus and cores < world_size:
        warnings.warn(
            f"keras_tp.launch: {world_size} ranks share {cores} CPU cores, "
            "so they take turns on them and every step waits for the "
            f"slowest rank. Each rank computes with {threads} thread(s); "
            f"start at most {cores} ranks for speed.",
            stacklevel=2,
        )
    payload = _pickle_by_value((train_fn, args, kwargs))
    port = master_port or _free_port(master_addr)
    with tempfile.TemporaryDirectory(prefix="keras_tp_launch_") as workdir:
        # Ranks import keras (through keras_tp) and torch before anything
        # else runs: they must start with this process' backend and with
        # their share of the cores.
        with _environment(KERAS_BACKEND="torch", OMP_NUM_THREADS=str(threads)):
            context = mp.start_processes(
                _run_rank,
                args=(world_size, master_addr, port, payload, workdir),
                nprocs=world_size,
                join=False,
                start_method="spawn",
            )
        try:
            _wait(context, timeout, workdir)
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
            _write_error(workdir, rank, e)
            raise
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def _wait(context, timeout, workdir):
    """Joins the ranks; raises on the first failure or on timeout."""
    from torch.multiprocessing import ProcessExitedException
    from torch.multiprocessing import ProcessRaisedException

    deadline = time.monotonic() + timeout
    try:
        while not context.join(
            timeout=max(0.0, min(1.0, deadline - time.monotonic())),
            grace_period=_GRACE_SECONDS,
        ):
            if time.monotonic() >= deadline:
                _stop_on_timeout(context, timeout, workdir)
    except ProcessRaisedException as e:
        _reraise(workdir, e.error_index, str(e), len(context.processes))
    except ProcessExitedException as e:
        raise RankError(
            f"Rank {e.error_index} (pid {e.error_pid}) died without raising "
            f"an exception: {e}. The other ranks were stopped."
        ) from None


def _stop_on_timeout(context, timeout, workdir):
    running = [r for r, p in enumerate(context.processes) if p.is_alive()]
    for rank in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(context.processes[rank].pid, signal.SIGUSR1)
    time.sleep(_GRACE_SECONDS)
    for rank in running:
        context.processes[rank].kill()
        context.processes[rank].join()
    stacks = []
    for rank in running:
        with open(_stack_path(workdir, rank)) as f:
            stacks.append(f"-- Rank {rank} was at:\n{f.read().strip()}")
    finished = sorted(set(range(len(context.processes))) - set(running))
    raise RankTimeoutError(
        f"keras_tp.launch timed out after {timeout} s: rank(s) "
        f"{', '.join(map(str, running))} still running and were stopped "
        f"(finished: {finished or 'none'}). A rank waiting in a collective "
        "is usually waiting for a rank that is elsewhere.\n\n"
        + "\n\n".join(stacks)
    )


def _write_error(workdir, rank, error):
    text = traceback.format_exc()
    try:
        blob = pickle.dumps(error)
        pickle.loads(blob)
    except Exception:
        blob = None
    with open(_error_path(workdir, rank), "wb") as f:
        pickle.dump((blob, text, time.time()), f)


def _reraise(workdir, rank, message, world_size):
    """Raises the first failed rank's exception, its traceback as cause.

    `rank` is the rank whose exit was noticed; when several ranks failed,
    the one that failed first is the cause (the others usually lost their
    connection to it), so its exception is the one raised.
    """
    errors = {}
    for other in range(world_size):
        path = _error_path(workdir, other)
        if os.path.exists(path):
            with open(path, "rb") as f:
                errors[other] = pickle.load(f)
    if errors:
        rank = min(errors, key=lambda r: errors[r][2])
        blob, text, _ = errors[rank]
        if blob is not None:
            error = pickle.loads(blob)
            error.add_note(f"(raised on rank {rank} of keras_tp.launch)")
            raise error from RemoteTraceback(f"\n\nRank {rank}: {text}")
        message = f"\n\nRank {rank}: {text}"
    raise RankError(f"Rank {rank} failed:{message}")


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
