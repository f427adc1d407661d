"""The rank processes of `keras_tp.launch`: their body, and how they end.

`torch.distributed.elastic`'s agent starts the ranks (`run_rank` in each),
supervises them and hosts their rendezvous. A rank writes its exception,
with its traceback, to the attempt's working directory; `failure` turns
what the ranks left there, and how the agent saw their processes end,
into the one failure `launch` raises (`AttemptFailed`).
"""

import ast
import faulthandler
import os
import pickle
import signal
import sys
import threading
import time
import traceback

from keras_tp.errors import AttemptFailed
from keras_tp.errors import RankError
from keras_tp.errors import RankLostError
from keras_tp.errors import RankTimeoutError
from keras_tp.errors import RemoteTraceback

# Seconds the other ranks have to end by themselves once a rank failed
# (they usually raise about the lost rank, which names it), before the
# agent kills them.
GRACE_SECONDS = 3

# How long a rank that raised waits before it exits (`run_rank`): ten of
# the agent's polls.
_REPORTED_FIRST_SECONDS = 1.0

# What every rank imports before `train_fn` runs, in the order the fork
# server imports them for the ranks (`launcher._start_forkserver`).
RANK_MODULES = (
    "torch",
    "torch.distributed",
    "torch.distributed.elastic.multiprocessing.api",
    "keras",
    "keras_tp.collectives.torch",
    "keras_tp.runtime.torch.liveness",
)

# What the agent tells each rank, kept over the launching process'
# environment (`run_rank`), but for the restarts, which `launch` counts.
_AGENT_VARIABLES = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
_RESTART_VARIABLES = ("TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")


def run_rank(nproc_per_node, payload, workdir, environment, timeout):
    """The body of one rank's process, which the agent starts.

    The rank runs with `environment` (the launching process' at launch
    time, and `launch`'s restart count) as its own, as a spawned process
    would, and the agent's rank and rendezvous; it is numbered as torchrun
    numbers the ranks of nodes of `nproc_per_node` ranks each. After
    `timeout` seconds it writes its stack and exits. Returns `train_fn`'s
    result on rank 0, `None` on the others.
    """
    agent = {
        name: value
        for name, value in os.environ.items()
        if name in _AGENT_VARIABLES
        or name.startswith("TORCHELASTIC_")
        and name not in _RESTART_VARIABLES
    }
    os.environ.clear()
    os.environ.update({**environment, **agent})
    rank, world_size = int(agent["RANK"]), int(agent["WORLD_SIZE"])
    node, local_rank = divmod(rank, nproc_per_node)
    os.environ.update(
        LOCAL_RANK=str(local_rank),
        GROUP_RANK=str(node),
        LOCAL_WORLD_SIZE=str(
            min(nproc_per_node, world_size - node * nproc_per_node)
        ),
    )
    ending = _EndAfterGrace()
    import torch
    import torch.distributed as dist

    from keras_tp.collectives.torch import TorchCollectiveAdapter
    from keras_tp.runtime.torch import liveness

    # The fork server imported torch before this rank's OMP_NUM_THREADS.
    torch.set_num_threads(int(environment["OMP_NUM_THREADS"]))
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    with open(_stack_path(workdir, rank), "w") as stack_file:
        faulthandler.dump_traceback_later(timeout, exit=True, file=stack_file)
        try:
            train_fn, args, kwargs = pickle.loads(payload)
            # `keras_tp.collectives` functions work anywhere in the rank.
            with TorchCollectiveAdapter().activated():
                result = train_fn(*args, **kwargs)
        except Exception as e:
            # A collective that failed for a lost or stuck rank says which.
            named = liveness.rank_lost_error(e)
            if named is not None:
                named.__cause__ = e
            _write_error(workdir, rank, named or e)
            ending.training = False
            # The agent reports the first rank it sees end: a rank that died
            # without an exception, whose peers' collectives fail at once,
            # ends before this one, which the agent then stops.
            time.sleep(_REPORTED_FIRST_SECONDS)
            # Said in full by `launch`, in the caller's process.
            sys.exit(1)
        finally:
            ending.training = False
            faulthandler.cancel_dump_traceback_later()
            liveness.stop_watching()
            if dist.is_initialized():
                dist.destroy_process_group()
    return result if rank == 0 else None


class _EndAfterGrace:
    """Once one rank failed, the agent stops the others with SIGTERM: a
    rank still in `train_fn` gets `GRACE_SECONDS` to end by itself
    (naming the lost rank), then exits; one done with it exits at once.
    SIGTERM is blocked in every thread but this one's, made before any
    other, so it comes here even while the main thread waits in a
    collective's native code."""

    def __init__(self):
        self.training = True
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        threading.Thread(target=self._wait, daemon=True).start()

    def _wait(self):
        signal.sigwait({signal.SIGTERM})
        if self.training:
            time.sleep(GRACE_SECONDS)
        os._exit(128 + signal.SIGTERM)


def failure(failures, workdir, world_size, timeout, elapsed):
    """What `launch` raises for an attempt whose ranks failed.

    Args:
        failures: `{rank: ProcessFailure}` of the ranks the agent saw fail
            first (`ChildFailedError.failures`); it stopped the others.
        workdir: the attempt's working directory.
        world_size: the attempt's number of ranks.
        timeout: the attempt's timeout, in seconds.
        elapsed: how long the attempt ran, in seconds.

    Returns:
        `RankTimeoutError` if ranks outlived `timeout`, else the
        `AttemptFailed` of the attempt: a rank that ended without an
        exception (killed, crashed, `os._exit`) is lost, and is the
        cause; otherwise the first exception raised is.
    """
    stacks = {
        rank: _read(_stack_path(workdir, rank)) for rank in range(world_size)
    }
    running = [rank for rank, stack in stacks.items() if stack]
    if running and elapsed >= timeout:
        return _timed_out(running, stacks, world_size, timeout)
    errors = _read_errors(workdir, world_size)
    died = sorted(rank for rank in failures if rank not in errors)
    lost = set(died)
    for blob, _, _ in errors.values():
        error = pickle.loads(blob) if blob is not None else None
        if isinstance(error, RankLostError):
            lost.update(error.ranks)
    if died or not errors:
        rank = (died or sorted(failures))[0]
        process = failures[rank]
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


def _timed_out(running, stacks, world_size, timeout):
    finished = sorted(set(range(world_size)) - set(running))
    shown = [f"-- Rank {rank} was at:\n{stacks[rank]}" for rank in running]
    return RankTimeoutError(
        f"keras_tp.launch timed out after {timeout} s: rank(s) "
        f"{', '.join(map(str, running))} still running and were stopped "
        f"(finished: {finished or 'none'}). A rank waiting in a collective "
        "is usually waiting for a rank that is elsewhere.\n\n"
        + "\n\n".join(shown)
    )


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


def _describe_exit(exitcode):
    if exitcode < 0:
        try:
            return f"signal {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit code {exitcode}"


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


def _read(path):
    if not os.path.exists(path):
        return ""
    with open(path) as f:
        return f.read().strip()


def _stack_path(workdir, rank):
    return os.path.join(workdir, f"stack_rank{rank}.txt")


def _error_path(workdir, rank):
    return os.path.join(workdir, f"error_rank{rank}.pkl")
