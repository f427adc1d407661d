"""Pipeline schedules: each of `P` stages' ordered actions on `M`
microbatches. The forward of microbatch `m` on stage `s` needs it on stage
`s - 1`; the backward needs it on stage `s + 1` and its own forward."""

import collections
import itertools
import math

from keras_tp.errors import check_count

FORWARD = "forward"
BACKWARD = "backward"

Action = collections.namedtuple("Action", ["stage", "kind", "microbatch"])
Action.__doc__ = """One step of a schedule: stage `stage` runs the `kind`
(`"forward"` or `"backward"`) pass of microbatch `microbatch`."""


def gpipe(num_stages, num_microbatches):
    """The GPipe schedule (Huang et al., 2019): all forwards, then all
    backwards; it holds all `M` microbatches' activations at its peak.

    Args:
        num_stages: number of pipeline stages `P`, at least 1.
        num_microbatches: number of microbatches `M`, at least 1.

    Returns:
        A list of `P` lists of `Action`s: stage `s`'s actions in order.

    Example:

    ```python
    [a.kind[0] + str(a.microbatch) for a in gpipe(2, 2)[1]]
    # ["f0", "f1", "b0", "b1"]
    ```
    """
    return _flushed(num_stages, num_microbatches, lambda s: num_microbatches)


def one_f_one_b(num_stages, num_microbatches):
    """The 1F1B schedule (PipeDream-Flush), as in Megatron-LM: stage `s`
    runs `min(P - s - 1, M)` warm-up forwards, then alternates one forward
    and one backward, then runs the remaining backwards. Arguments and
    result as `gpipe`'s.

    Example:

    ```python
    [a.kind[0] + str(a.microbatch) for a in one_f_one_b(3, 4)[0]]
    # ["f0", "f1", "f2", "b0", "f3", "b1", "b2", "b3"]
    ```
    """
    return _flushed(num_stages, num_microbatches, lambda s: num_stages - s - 1)


def _flushed(num_stages, num_microbatches, warmup):
    # As `one_f_one_b`, with `min(warmup(s), M)` warm-ups on stage `s`.
    check_count("num_stages", num_stages)
    check_count("num_microbatches", num_microbatches)
    schedule = []
    for s in range(num_stages):
        first = min(warmup(s), num_microbatches)
        actions = [Action(s, FORWARD, m) for m in range(first)]
        for m in range(num_microbatches):
            if first + m < num_microbatches:
                actions.append(Action(s, FORWARD, first + m))
            actions.append(Action(s, BACKWARD, m))
        schedule.append(actions)
    return schedule


Span = collections.namedtuple("Span", ["action", "start", "end"])


class Timeline:
    """When each action of a schedule runs: what `simulate` returns.

    Attributes:
        num_stages: number of stages.
        spans: for each stage, its `Span`s `(action, start, end)` in the
            order it runs them.
        makespan: when the last action ends (every stage starts at 0).
    """

    def __init__(self, spans):
        self.spans = spans
        self.num_stages = len(spans)
        self.makespan = max(
            (span.end for stage in spans for span in stage), default=0.0
        )

    def busy(self, stage):
        """Total time stage `stage` spends running actions."""
        return sum(span.end - span.start for span in self.spans[stage])

    def span_of(self, action):
        for span in self.spans[action.stage]:
            if span.action == action:
                return span
        raise KeyError(f"{action} is not in this timeline.")

    def chart(self, unit=None):
        """A text chart, a row per stage, a character per `unit`: a
        forward's microbatch digit, a backward's letter (`a` for 0), idle
        time `.`.

        Args:
            unit: time per character; by default the shortest action.

        Returns:
            A string.
        """
        if unit is None:
            unit = min(
                (e - s for stage in self.spans for _, s, e in stage if e > s),
                default=1.0,
            )
        width = int(math.ceil(self.makespan / unit - 1e-9))
        rows = []
        for stage, spans in enumerate(self.spans):
            cells = ["."] * width
            for (_, kind, m), start, end in spans:
                mark = (
                    str(m % 10) if kind == FORWARD else chr(ord("a") + m % 26)
                )
                last = min(int(round(end / unit)), width)
                for i in range(int(round(start / unit)), last):
                    cells[i] = mark
            rows.append(f"stage {stage}: " + "".join(cells))
        return "\n".join(rows)

    def __repr__(self):
        return (
            f"<Timeline: {self.num_stages} stages, makespan {self.makespan:g}>"
        )


def simulate(schedule, forward_time=1.0, backward_time=2.0):
    """Runs a schedule on given action times, each action once its stage's
    previous action and those it needs have ended (sends take no time).

    Args:
        schedule: a list of per-stage action lists (`gpipe`,
            `one_f_one_b`, or one written by hand).
        forward_time: time of one forward: a number, or one per stage.
        backward_time: time of one backward: a number, or one per stage
            (twice the forward is the usual rule).

    Returns:
        A `Timeline`.

    Raises:
        ValueError: for a malformed schedule, or one that deadlocks (a
            stage's next action waits for an action that waits for it).
    """
    schedule = _normalized(schedule)
    num_stages = len(schedule)
    forward = _per_stage(forward_time, num_stages, "forward_time")
    backward = _per_stage(backward_time, num_stages, "backward_time")
    ends = {}
    spans = [[] for _ in schedule]
    progressed = True
    while progressed:
        progressed = False
        for s, actions in enumerate(schedule):
            for action in actions[len(spans[s]) :]:
                needs = _dependencies(action, num_stages)
                if any(need not in ends for need in needs):
                    break
                free = spans[s][-1].end if spans[s] else 0.0
                start = max([free] + [ends[need] for need in needs])
                duration = forward[s] if action.kind == FORWARD else backward[s]
                ends[action] = start + duration
                spans[s].append(Span(action, start, ends[action]))
                progressed = True
    waiting = [
        f"stage {s} at {actions[len(spans[s])]}"
        for s, actions in enumerate(schedule)
        if len(spans[s]) < len(actions)
    ]
    if waiting:
        raise ValueError(
            "The schedule deadlocks: each stage's next action waits for "
            "an action that cannot run first: " + "; ".join(waiting)
        )
    return Timeline(spans)


def timeline_of(order, times):
    """The `Timeline` of actions `order` run at `times`, moved to start at 0."""
    origin = float(min(start for start, _ in times))
    spans = [[] for _ in range(1 + max(action.stage for action in order))]
    for action, (start, end) in zip(order, times):
        span = Span(Action(*action), float(start) - origin, float(end) - origin)
        spans[action.stage].append(span)
    return Timeline(spans)


def bubble_fraction(timeline):
    """The fraction of the step each stage is idle, measured.

    Args:
        timeline: a `Timeline` from `simulate`, or one measured from a
            training step (`TensorParallelKeras.pipeline_timeline()`).

    Returns:
        A list of floats, one per stage: `1 - busy / makespan`.
    """
    if timeline.makespan <= 0:
        return [0.0] * timeline.num_stages
    return [
        1.0 - timeline.busy(s) / timeline.makespan
        for s in range(timeline.num_stages)
    ]


def ideal_bubble(num_stages, num_microbatches):
    """`(P - 1) / (M + P - 1)`: the idle share of GPipe and 1F1B with
    equal stages, whatever the ratio of backward to forward time."""
    check_count("num_stages", num_stages)
    check_count("num_microbatches", num_microbatches)
    return (num_stages - 1) / (num_microbatches + num_stages - 1)


def peak_activations(schedule):
    """Per stage, the most microbatches held between forward and backward
    (GPipe: `M`; 1F1B: `min(P - s, M)` on stage `s`).

    Args:
        schedule: a list of per-stage action lists, or every stage's
            actions in one order (`issue_order`).

    Returns:
        A list of ints, one per stage.
    """
    if schedule and isinstance(schedule[0], Action):
        stages = range(1 + max(a.stage for a in schedule))
        schedule = [[a for a in schedule if a.stage == s] for s in stages]
    steps = [
        [1 if a.kind == FORWARD else -1 for a in actions]
        for actions in _normalized(schedule)
    ]
    return [max(itertools.accumulate(held, initial=0)) for held in steps]


def _dependencies(action, num_stages):
    s, kind, m = action
    if kind == FORWARD:
        return [Action(s - 1, FORWARD, m)] if s > 0 else []
    later = [Action(s + 1, BACKWARD, m)] if s < num_stages - 1 else []
    return [Action(s, FORWARD, m)] + later


def _per_stage(value, num_stages, name):
    if isinstance(value, (int, float)):
        values = [float(value)] * num_stages
    else:
        values = [float(v) for v in value]
        if len(values) != num_stages:
            raise ValueError(
                f"{name} has {len(values)} values for {num_stages} stages; "
                "give one number, or one per stage."
            )
    if any(v < 0 or math.isnan(v) for v in values):
        raise ValueError(f"{name} must be >= 0, got {value!r}.")
    return values


def _normalized(schedule):
    """The schedule as lists of `Action`s, checked."""
    if not isinstance(schedule, (list, tuple)) or not schedule:
        raise ValueError(
            "A schedule is a non-empty list of per-stage action lists, "
            f"got {schedule!r}."
        )
    normalized = []
    for s, actions in enumerate(schedule):
        seen = {}  # an ordered set
        for action in (Action(*a) for a in actions):
            if action.stage != s:
                raise ValueError(
                    f"Stage {s}'s list holds {action}, an action of stage "
                    f"{action.stage}."
                )
            if action.kind not in (FORWARD, BACKWARD):
                raise ValueError(
                    f"{action}: kind must be '{FORWARD}' or '{BACKWARD}'."
                )
            if action in seen:
                raise ValueError(f"{action} appears twice in stage {s}.")
            seen[action] = None
        normalized.append(list(seen))
        f = {a.microbatch for a in seen if a.kind == FORWARD}
        b = {a.microbatch for a in seen if a.kind == BACKWARD}
        if not b <= f:
            raise ValueError(
                f"Stage {s} runs the backward of microbatches "
                f"{sorted(b - f)} but not their forward."
            )
        if s == 0:
            forwards, backwards = f, b
        elif (f, b) != (forwards, backwards):
            raise ValueError(
                f"Stage {s} runs forwards {sorted(f)} and backwards "
                f"{sorted(b)}; stage 0 runs forwards {sorted(forwards)} "
                f"and backwards {sorted(backwards)}: every stage must run "
                "the same microbatches."
            )
    return normalized


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def check_schedule_name(name):
    if name not in SCHEDULES:
        raise ValueError(
            f"schedule must be one of {sorted(SCHEDULES)}, got {name!r}."
        )


def issue_order(name, num_stages, num_microbatches):
    """All stages' actions of schedule `name` in one list, each after those
    it needs (by simulated start)."""
    check_schedule_name(name)
    timeline = simulate(SCHEDULES[name](num_stages, num_microbatches))
    spans = [span for stage in timeline.spans for span in stage]
    return [span.action for span in sorted(spans, key=lambda s: s.start)]


def check_microbatches(batch_size, num_microbatches):
    if batch_size % num_microbatches:
        raise ValueError(
            f"A batch of {batch_size} samples cannot be split into "
            f"num_microbatches={num_microbatches} equal micro-batches; use "
            "a batch size divisible by it."
        )
