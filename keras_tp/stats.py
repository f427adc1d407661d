"""Counting of collective calls and bytes, per training phase."""

import collections
import contextlib

_DIRECTIONS = ("forward", "backward")


class CommunicationStats:
    """Ledger of the collectives issued by one phase of a step.

    A phase (`"train"`, `"test"`, `"predict"` or `"call"`) is opened with
    `recording(phase)`, which clears that phase's previous records. Adapters
    call `record()` whenever a collective is issued. On backends that trace
    their step once (JAX, TensorFlow) the records are written while the step
    is traced, which is exact because a compiled step issues the same
    collectives every time it runs; eager backends (torch) record every step.

    Bytes are the size of the local buffer each rank contributes to the call.
    """

    def __init__(self):
        self._records = {}
        # Process-wide, not per thread: torch runs CUDA backward passes on
        # worker threads, whose collectives belong to the same step.
        self.active_phase = None

    @contextlib.contextmanager
    def recording(self, phase):
        """Records the collectives issued inside the block under `phase`.

        Nested blocks keep the outermost phase, so that a forward pass run
        by a training step counts toward the training step.
        """
        if self.active_phase is not None:
            yield
            return
        self._records[phase] = []
        self.active_phase = phase
        try:
            yield
        finally:
            self.active_phase = None

    def record(self, kind, nbytes, direction="forward"):
        """Adds one collective call of `kind` moving `nbytes` per rank."""
        if direction not in _DIRECTIONS:
            raise ValueError(
                f"`direction` must be one of {_DIRECTIONS}, got {direction!r}."
            )
        phase = self.active_phase
        if phase is None:
            return
        self._records[phase].append((kind, int(nbytes), direction))

    def summary(self, phase="train"):
        """Returns `{kind: {calls, bytes, forward_calls, ...}}` for `phase`."""
        totals = collections.defaultdict(
            lambda: {
                "calls": 0,
                "bytes": 0,
                "forward_calls": 0,
                "forward_bytes": 0,
                "backward_calls": 0,
                "backward_bytes": 0,
            }
        )
        for kind, nbytes, direction in self._records.get(phase, []):
            entry = totals[kind]
            entry["calls"] += 1
            entry["bytes"] += nbytes
            entry[f"{direction}_calls"] += 1
            entry[f"{direction}_bytes"] += nbytes
        return dict(totals)

    def reset(self):
        self._records.clear()
