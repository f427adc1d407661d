"""The exceptions keras_tp raises, and the check of a count argument, in
one module that imports nothing of keras_tp.

Every part of keras_tp can raise these without importing the part that
catches them: the launcher, the rank processes and the backends'
liveness checks share the rank errors, the planner and the command line
share `ShardingError`. `keras_tp.RankLostError`, `keras_tp.ShardingError`
and `keras_tp.CheckpointError` are the same classes.
"""

import numbers


def check_count(name, value, least=1, hint=""):
    """Raises `ValueError` unless `value` is an integer (not a bool) of at
    least `least`.

    Args:
        name: the argument, as the message names it.
        value: what was given.
        least: the smallest count allowed.
        hint: what the message adds after "an integer >= {least}" (what
            else the argument takes).
    """
    is_integer = isinstance(value, numbers.Integral)
    if isinstance(value, bool) or not is_integer or value < least:
        raise ValueError(
            f"{name} must be an integer >= {least}{hint}, got {value!r}."
        )


class ShardingError(ValueError):
    """A plan asks for a split that cannot be done exactly."""


class CheckpointError(ValueError):
    """A checkpoint is missing, damaged, or does not fit the model."""


class RankError(RuntimeError):
    """A rank failed; the message says which and how.

    Raised when a rank's exception cannot be re-raised as itself (it does
    not pickle), when a rank dies without an exception, or, as a
    `RankTimeoutError`, when ranks outlive the timeout.
    """


class RankTimeoutError(RankError, TimeoutError):
    """Ranks were still running when `launch`'s timeout expired."""


class _RanksNamedError(RankError):
    """A rank's error that names other ranks (`ranks`) and itself (`rank`)."""

    def __init__(self, message, ranks=(), rank=None):
        super().__init__(message)
        self.ranks = tuple(ranks)
        self.rank = rank

    def __reduce__(self):
        # Pickled from a rank to the caller of `launch`.
        return type(self), (self.args[0], self.ranks, self.rank)


class RankLostError(_RanksNamedError):
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


class RankStuckError(_RanksNamedError):
    """A collective timed out because other ranks, alive, never entered it.

    Raised on the rank whose collective waited `KERAS_TP_COLLECTIVE_TIMEOUT`
    seconds, in place of the backend's own "Timed out waiting" error
    (its `__cause__`), when every rank's heartbeat still beats: the
    message names the ranks that never entered the collective, the last
    collective each entered and its Python stack. Unlike a `RankLostError`,
    the stuck ranks are not lost: `launch(max_restarts=...)` restarts the
    job at the same size.

    Attributes:
        ranks: the ranks that never entered the collective.
        rank: the rank that raised.
    """


class RemoteTraceback(Exception):
    """The traceback of an exception raised on another rank, as text."""

    def __str__(self):
        return self.args[0]


class AttemptFailed(Exception):
    """An attempt's ranks failed: what to raise, and which ranks were lost.

    Passed from `keras_tp.rank_processes` to `launch`, which restarts the
    job or raises `error`; it never reaches the user.

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


class CommandError(Exception):
    """A user error of the `keras-tp` command.

    Reported as one line on stderr with exit status 1.
    """
