"""Counting of collective calls and bytes, per training phase."""

import collections
import contextlib
import threading

_DIRECTIONS = ("forward", "backward", "optimizer")


class CommunicationStats:
    """Ledger of the collectives issued by one phase of a step.

    A phase (`"train"`, `"test"`, `"predict"` or `"call"`) is opened with
    `recording(phase)`, which clears that phase's previous records. Adapters
    call `record()` whenever a collective is issued. On backends that trace
    their step once (JAX, TensorFlow) the records are written while the step
    is traced, which is exact because a compiled step issues the same
    collectives every time it runs; eager backends (torch) record every step.

    Bytes are the size of the whole buffer of the call, as NCCL counts it:
    the input of an all-reduce, reduce-scatter or broadcast, the output of
    an all-gather. Each record also names the mesh axis it ran over and
    whether it served the forward pass, the backward pass or the optimizer
    (gradient synchronisation, parameter gathering).
    """

    def __init__(self):
        self._records = {}
        # Process-wide, not per thread: torch runs CUDA backward passes on
        # worker threads, whose collectives belong to the same step.
        self.active_phase = None
        self._label = None
        # Per thread: TensorFlow runs each replica's step in a thread, and
        # a replica paused inside a conditional must not tag another's
        # records.
        self._conditions = threading.local()

    @contextlib.contextmanager
    def labelled(self, direction):
        """Records collectives of the block under `direction` by default."""
        previous, self._label = self._label, direction
        try:
            yield
        finally:
            self._label = previous

    @contextlib.contextmanager
    def conditional(self, ran):
        """Records the block's collectives as issued only on some steps.

        A traced step (JAX, TensorFlow) holds both branches of a
        conditional, and its trace records the collectives of both; an
        eager step (torch) records only the branch it took. `summary()`
        asks `ran` whether the last step of the phase ran the block, so
        both count what the step really sent.

        Args:
            ran: function of no arguments returning whether the last step
                ran the block (read when the records are summarised).
        """
        previous = self._condition
        self._conditions.current = ran
        try:
            yield
        finally:
            self._conditions.current = previous

    @property
    def _condition(self):
        return getattr(self._conditions, "current", None)

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

    @contextlib.contextmanager
    def capturing(self):
        """Yields the list of the records the block adds to the open phase.

        For a function compiled once and called at every step: what it
        recorded while it was traced is `replay`ed at each later call.
        """
        phase = self.active_phase
        records = self._records.get(phase, []) if phase else []
        start = len(records)
        added = []
        try:
            yield added
        finally:
            added.extend(records[start:])

    @contextlib.contextmanager
    def discarding(self):
        """Drops the records the block adds: for a function traced only to
        learn the shapes of its results, whose collectives never run."""
        phase = self.active_phase
        records = self._records.get(phase, []) if phase else []
        start = len(records)
        try:
            yield
        finally:
            del records[start:]

    def replay(self, records):
        """Adds `records` (from `capturing`) to the open phase again."""
        if self.active_phase is not None:
            self._records[self.active_phase].extend(records)

    def record(self, kind, nbytes, direction=None, axis="model"):
        """Adds one collective call of `kind` moving `nbytes` over `axis`."""
        direction = direction or self._label or "forward"
        if direction not in _DIRECTIONS:
            raise ValueError(
                f"`direction` must be one of {_DIRECTIONS}, got {direction!r}."
            )
        phase = self.active_phase
        if phase is None:
            return
        self._records[phase].append(
            (kind, int(nbytes), direction, axis, self._condition)
        )

    def summary(self, phase="train", axis=None):
        """Returns `{kind: {calls, bytes, forward_calls, ...}}` for `phase`.

        Args:
            phase: the phase whose last step to summarise.
            axis: only the collectives over this mesh axis: `"model"`,
                `"data"`, or `("data", "model")` for those over the whole
                mesh (the norms of gradient clipping); `None` counts all.
                An axis includes its levels: `"data"` counts
                `"data/within_host"` and `"data/across_hosts"` (a
                hierarchical reduction), which can also be asked for alone.

        A collective recorded in a `conditional` block counts only if the
        last step ran the block.
        """
        totals = collections.defaultdict(
            lambda: {
                "calls": 0,
                "bytes": 0,
                "forward_calls": 0,
                "forward_bytes": 0,
                "backward_calls": 0,
                "backward_bytes": 0,
                "optimizer_calls": 0,
                "optimizer_bytes": 0,
            }
        )
        ran = {}
        for kind, nbytes, direction, on_axis, condition in self._records.get(
            phase, []
        ):
            if axis is not None and not _on_axis(on_axis, axis):
                continue
            if condition is not None:
                if condition not in ran:
                    ran[condition] = bool(condition())
                if not ran[condition]:
                    continue
            entry = totals[kind]
            entry["calls"] += 1
            entry["bytes"] += nbytes
            entry[f"{direction}_calls"] += 1
            entry[f"{direction}_bytes"] += nbytes
        return dict(totals)

    def reset(self):
        self._records.clear()


def _on_axis(record_axis, axis):
    """Whether a collective over `record_axis` ran over `axis` or a level
    of it."""
    if record_axis == axis:
        return True
    return isinstance(record_axis, str) and record_axis.startswith(f"{axis}/")
