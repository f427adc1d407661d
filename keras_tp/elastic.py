"""Elastic restarts and collectives that fail instead of hanging.

A job started by `keras_tp.launch(..., max_restarts=K)` or by `torchrun
--max-restarts K` runs its training function again after a failure, in
fresh processes. The function learns where it is from the variables
torchrun sets, read here: the number of ranks of this attempt
(`elastic_world_size()`) and how many restarts came before
(`restart_count()`); it resumes from its last checkpoint.

A collective waits at most `KERAS_TP_COLLECTIVE_TIMEOUT` seconds for the
other ranks (torch: the process group's timeout; TensorFlow multi-worker:
the strategy's `CommunicationOptions`). When one fails because a rank died
or froze, the backend's error says little (gloo names a socket, TensorFlow
a task only sometimes); each backend's runtime turns it into a
`keras_tp.RankLostError` that names the rank, with `rank_lost_error`
functions this module installs as the process' last word on an uncaught
exception (`install_failure_hook`), so a script run by torchrun or by
TensorFlow's cluster tools ends with that error too.
"""

import os
import sys

from keras_tp import mpi

COLLECTIVE_TIMEOUT_VARIABLE = "KERAS_TP_COLLECTIVE_TIMEOUT"

_EXPLAINERS = []
_PREVIOUS_HOOK = None


def restart_count():
    """How many times this job was restarted before this attempt.

    `0` on the first attempt. Read from `TORCHELASTIC_RESTART_COUNT`, which
    torchrun's agent and `keras_tp.launch` set in every rank.

    Returns:
        The number of restarts before this attempt.

    Example:

    ```python
    if keras_tp.restart_count() > 0:
        print("resuming after a failure")
    ```
    """
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def elastic_world_size():
    """The number of ranks this attempt of the job runs on.

    Under `keras_tp.launch` or `torchrun`, `WORLD_SIZE`: after a restart
    that lost ranks, the ranks that are left. Under `mpirun`, the number
    of ranks it started (`keras_tp.mpi.mpi_rank()`). A training function
    passes it (or a divisor of it) to `TensorParallelKeras` so that it runs
    at whatever size it was restarted with. On JAX and TensorFlow, whose
    ranks are devices, the number of devices Keras lists.

    Returns:
        The number of ranks (torch) or devices (JAX, TensorFlow).

    Example:

    ```python
    def train():
        tp = keras_tp.TensorParallelKeras(
            build_my_keras_model(), world_size=keras_tp.elastic_world_size()
        )
    ```
    """
    import keras

    if keras.backend.backend() == "torch":
        if "WORLD_SIZE" in os.environ:
            return int(os.environ["WORLD_SIZE"])
        # Before the process group exists, a rank of mpirun knows its
        # size from the launcher only.
        rank = mpi.mpi_rank()
        return 1 if rank is None else rank.world_size
    return len(keras.distribution.list_devices())


def collective_timeout():
    """Seconds a collective may wait, from `KERAS_TP_COLLECTIVE_TIMEOUT`.

    Returns:
        The timeout in seconds, or `None` when the variable is unset (the
        backend's default: 30 minutes for torch's gloo, none for
        TensorFlow's collectives).

    Raises:
        ValueError: if the variable is not a positive number.
    """
    value = os.environ.get(COLLECTIVE_TIMEOUT_VARIABLE, "").strip()
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise ValueError(
            f"{COLLECTIVE_TIMEOUT_VARIABLE}={value!r} must be a positive "
            "number of seconds, e.g. KERAS_TP_COLLECTIVE_TIMEOUT=300."
        )
    return seconds


def check_collective_timeout(seconds):
    """Returns `seconds` as a float, or raises if it is not positive."""
    if not float(seconds) > 0:
        raise ValueError(
            f"collective_timeout={seconds!r} must be a positive number of "
            "seconds."
        )
    return float(seconds)


def install_failure_hook(explain):
    """Makes an uncaught collective failure end as a `RankLostError`.

    `explain(error)` returns the `RankLostError` naming the lost ranks, or
    `None` for an error it does not explain. The process' `sys.excepthook`
    then shows the explained error, caused by the original one, in place
    of the original alone: a script run by torchrun, or a TensorFlow
    worker, ends with the name of the lost rank. Installing the same
    `explain` twice has no effect.

    Args:
        explain: a function of an exception, as described above.
    """
    global _PREVIOUS_HOOK
    if explain in _EXPLAINERS:
        return
    _EXPLAINERS.append(explain)
    if _PREVIOUS_HOOK is None:
        _PREVIOUS_HOOK = sys.excepthook
        sys.excepthook = _show_lost_ranks


def _show_lost_ranks(kind, error, traceback):
    if isinstance(error, Exception):
        for explain in _EXPLAINERS:
            try:
                explained = explain(error)
            except Exception:
                # The original error is more useful than a failed diagnosis.
                explained = None
            if explained is not None:
                error.__traceback__ = traceback
                explained.__cause__ = error
                _PREVIOUS_HOOK(type(explained), explained, None)
                return
    _PREVIOUS_HOOK(kind, error, traceback)
