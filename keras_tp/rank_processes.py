"""The rank processes of `keras_tp.launch`: their body, and how they end.

`launch` starts the ranks (`run_rank` in each) and `wait`s for them. A rank
writes its result, or its exception with its traceback, to the attempt's
working directory; `wait` turns what the ranks left there, and how their
processes ended, into the one failure `launch` raises (`AttemptFailed`),
and stops ranks that outlive the timeout after asking each for its stack.
"""

import ast
import contextlib
import faulthandler
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time
import traceback

from keras_tp.errors import AttemptFailed
from keras_tp.errors import RankError
from keras_tp.errors import RankLostError
from keras_tp.errors import RankStuckError
from keras_tp.errors import RankTimeoutError
from keras_tp.errors import RemoteTraceback

# Seconds a rank has to write its stack after a timeout, and to exit after
# another rank failed.
_GRACE_SECONDS = 3.0

# What every rank imports before `train_fn` runs, in the order the fork
# server imports them for the ranks (`launcher._start_forkserver`).
RANK_MODULES = (
    "torch",
    "torch.distributed",
    "keras",
    "keras_tp.collectives.torch",
    "keras_tp.runtime.torch.liveness",
)


def run_rank(
    rank,
    world_size,
    nproc_per_node,
    master_addr,
    master_port,
    payload,
    workdir,
    environment,
):
    """The body of one rank's process (top level, so the fork server can
    import it).

    The rank runs with `environment` (the launching process' at launch
    time) as its own, as a spawned process would. The ranks are numbered
    as torchrun numbers them on nodes of `nproc_per_node` ranks each.
    """
    node, local_rank = divmod(rank, nproc_per_node)
    ranks_on_node = min(nproc_per_node, world_size - node * nproc_per_node)
    os.environ.clear()
    os.environ.update(environment)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(local_rank),
        GROUP_RANK=str(node),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(ranks_on_node),
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
    )
    import torch
    import torch.distributed as dist

    from keras_tp.collectives.torch import TorchCollectiveAdapter
    from keras_tp.runtime.torch import liveness

    # The fork server imported torch before this rank's OMP_NUM_THREADS.
    torch.set_num_threads(int(environment["OMP_NUM_THREADS"]))
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
            # A collective that failed for a lost or stuck rank says which.
            named = liveness.rank_lost_error(e)
            if named is None:
                _write_error(workdir, rank, e)
                raise
            named.__cause__ = e
            _write_error(workdir, rank, named)
            raise named from e
        finally:
            liveness.stop_watching()
            if dist.is_initialized():
                dist.destroy_process_group()


def wait(processes, timeout, workdir):
    """Waits for the ranks; returns when every rank finished.

    On the first failure, the other ranks get `_GRACE_SECONDS` to end by
    themselves (they usually raise about the lost rank, which names it),
    then are stopped; ranks that a `RankStuckError` named as stuck are
    stopped at once.

    Raises:
        AttemptFailed: if a rank failed.
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
    running = {r for r, p in enumerate(processes) if p.is_alive()}
    if not running <= _named_stuck(workdir, failed):
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


def _named_stuck(workdir, failed):
    """The ranks that the `RankStuckError`s of ranks `failed` name."""
    named = set()
    for blob, _, _ in _read_errors(workdir, max(failed) + 1).values():
        error = pickle.loads(blob) if blob is not None else None
        if isinstance(error, RankStuckError):
            named.update(error.ranks)
    return named


def _join_all(processes, seconds):
    deadline = time.monotonic() + seconds
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))


def _unguarded_script():
    """The path of the script Python runs, when it has no `if __name__ ==
    "__main__":` block at its top level; `None` in a notebook, under
    `python -c` or `-m`, and for a guarded script."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not path or not path.endswith(".py") or not os.path.exists(path):
        return None
    with open(path) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        test = node.test if isinstance(node, ast.If) else None
        if isinstance(test, ast.Compare) and "__main__" in ast.dump(test):
            return None
    return path


def _failure(processes, first_failed, stopped, workdir):
    """The `AttemptFailed` of an attempt whose ranks `first_failed` failed.

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
        script = _unguarded_script()
        if script:
            error.add_note(
                f'The script {script} has no `if __name__ == "__main__":` '
                "block: each rank imports the script when it starts "
                "(Python's rule for processes that are not forked), so its "
                "top level, the call of keras_tp.launch included, runs "
                "again in every rank and fails there. Put the script's "
                'top-level calls under `if __name__ == "__main__":`.'
            )
        return AttemptFailed(error, None, lost, f"rank {rank} died ({how})")
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
    return AttemptFailed(error, cause, lost, summary)


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


def _stack_path(workdir, rank):
    return os.path.join(workdir, f"stack_rank{rank}.txt")


def _error_path(workdir, rank):
    return os.path.join(workdir, f"error_rank{rank}.pkl")
