"""`StalenessBound`: when a parameter server may apply what it received.

A worker pulls the parameters at some version, computes a gradient on its
slice of the data and pushes it. The gradient's *staleness* is how many
updates the server applied between that pull and the update that applies
the gradient. With `max_staleness=K` no gradient is ever applied more than
`K` updates late: an update waits while it would leave a worker that is
still computing more than `K` versions behind, and then applies, as one
optimizer step, the sample-weighted mean of every gradient waiting.

- `K = 0` is synchronous: an update waits for every worker's gradient, and
  applies their mean, as data parallelism does.
- `K >= workers - 1` never waits on a worker of the same speed: each
  gradient is applied on arrival (asynchronous SGD).
- A slow worker holds the others back only when they would otherwise run
  more than `K` updates ahead of it (stale synchronous parallel, Ho et al.
  2013).
- A worker that pushes without pulling (`pull_every > 1`) goes on from the
  parameters it holds, and still bounds the updates by their version.

The class is pure bookkeeping, without locks or communication, so that the
threads of the in-process servers and the message loop of a torch server
process apply the same rule.
"""

import collections
import dataclasses

from keras_tp.errors import check_count


@dataclasses.dataclass
class Pushed:
    """A gradient waiting at a server.

    Attributes:
        worker: the worker that pushed it.
        payload: what the server applies (the gradient and its weight).
        base_version: the version of the parameters it was computed on.
    """

    worker: int
    payload: object
    base_version: int


class StalenessBound:
    """Decides which pushed gradients a server applies, and when.

    Args:
        max_staleness: the most updates a gradient may be applied late.

    Example:

    ```python
    bound = StalenessBound(max_staleness=0)
    bound.start(0)
    bound.start(1)                        # both pulled version 0
    bound.push(0, "g0")
    assert not bound.ready()              # worker 1 is still computing
    bound.push(1, "g1")
    group = bound.take()                  # both, applied as one update
    assert [p.payload for p in group] == ["g0", "g1"]
    assert bound.version == 1
    ```
    """

    def __init__(self, max_staleness):
        check_count(
            "max_staleness", max_staleness, least=0, hint=" (0 is synchronous)"
        )
        self.max_staleness = max_staleness
        self.version = 0
        # Workers computing, and the version of the parameters they hold.
        self._computing = {}
        # Workers that pushed their last gradient until they start again.
        self._finished = set()
        self._waiting = []
        # How many gradients were applied with each staleness.
        self.histogram = collections.Counter()

    def start(self, worker):
        """`worker` holds the current parameters and computes from them.

        A worker starts once, before its first push; after an update that
        applied its gradient it counts as computing from the new version.
        Starting again (a later pull) moves it to the current version.
        """
        self._finished.discard(worker)
        self._computing[worker] = self.version

    def push(self, worker, payload, pulls=True):
        """`worker` pushes a gradient.

        Args:
            worker: the worker.
            payload: what the server applies.
            pulls: whether the worker waits for the gradient to be applied
                and then pulls the parameters; if not, it computes its next
                gradient from the parameters it holds, and still counts as
                computing from their version.
        """
        if worker not in self._computing:
            raise RuntimeError(
                f"Worker {worker} pushed a gradient without holding "
                "parameters from this server; it must pull first."
            )
        base = self._computing[worker]
        if pulls:
            del self._computing[worker]
        self._waiting.append(Pushed(worker, payload, base))

    def finish(self, worker):
        """`worker` pushes nothing more until it starts again (its data is
        used up), also if its last gradient still waits."""
        self._computing.pop(worker, None)
        self._finished.add(worker)

    def waits(self, worker):
        """Whether a gradient of `worker` waits to be applied."""
        return any(pushed.worker == worker for pushed in self._waiting)

    def ready(self):
        """Whether an update may apply the waiting gradients now."""
        if not self._waiting:
            return False
        after = self.version + 1
        return all(
            after - base <= self.max_staleness
            for base in self._computing.values()
        )

    def take(self):
        """The gradients of the next update, in worker order (a worker's
        own in the order it pushed them).

        Call only when `ready()`. The version advances by one, and the
        staleness of each gradient is recorded.

        Returns:
            A list of `Pushed`, to be applied as one optimizer step.
        """
        if not self.ready():
            raise RuntimeError("No update is ready; check ready() first.")
        group = sorted(self._waiting, key=lambda pushed: pushed.worker)
        self._waiting = []
        for pushed in group:
            self.histogram[self.version - pushed.base_version] += 1
        self.version += 1
        # The group's workers that pull compute next from these parameters
        # (or newer ones, if they pull later), unless they `finish`:
        # counting them as computing now keeps the next update from passing
        # them. Workers that did not pull keep their version; finished ones
        # stay finished.
        for pushed in group:
            if pushed.worker not in self._finished:
                self._computing.setdefault(pushed.worker, self.version)
        return group

    @property
    def idle(self):
        """Whether no worker computes and no gradient waits."""
        return not self._computing and not self._waiting
