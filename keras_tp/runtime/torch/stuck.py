"""Which ranks a timed-out torch collective waited for, and where they are.

A rank that is alive but stuck keeps its heartbeat beating, so `liveness`
finds nothing lost when a collective times out. Every rank counts the
collectives it enters, per process group (`keras_tp.collectives.recorder`);
the rank whose collective timed out asks every rank for a report
(`keras_tp.runtime.stuck.report`, sent by its heartbeat thread, which runs
while the main thread waits or sleeps) and names the ranks of the
collective's group whose count is lower: they never entered it. A rank
that itself waits in a collective of another group for ranks that never
entered that one is followed to them.
"""

from keras_tp import elastic
from keras_tp.collectives import recorder
from keras_tp.errors import RankStuckError
from keras_tp.runtime import stuck as shared

_COLLECTIVE_FILES = ("torch/distributed/", "keras_tp/collectives/")


def report(request):
    """This rank's answer to `request` (`keras_tp.runtime.stuck.report`)."""
    return shared.report(request, _COLLECTIVE_FILES)


def stuck_error(me, error, reported_line, reports, now):
    """The `RankStuckError` of a collective of rank `me` that timed out.

    Args:
        me: this rank.
        error: the backend's error.
        reported_line: the line of its message that says what it saw.
        reports: `{rank: report}` of the other ranks that answered.
        now: the time, to say how long ago each rank entered its last
            collective.

    Returns:
        The error (not raised), or `None` when this rank entered no
        collective it could have waited in.
    """
    # The collective that timed out is the last one this rank entered.
    mine = recorder.snapshot()["last"]
    if mine is None:
        return None
    reports = {
        **reports,
        me: {"recorder": recorder.snapshot(), "in_collective": True},
    }
    waiting = _waiting_for(mine, reports)
    stuck, chain = _follow(waiting, reports)
    if not stuck:
        # Every rank of the group entered it: name the ranks that are
        # not inside a collective now.
        stuck = [r for r, rep in reports.items() if r != me and not _waits(rep)]
    timeout = elastic.collective_timeout()
    waited = (
        f"after {timeout:g} s ({elastic.COLLECTIVE_TIMEOUT_VARIABLE})"
        if timeout
        else "after torch's default timeout"
    )
    if waiting:
        cause = (
            f"rank(s) {shared.names(waiting)} never entered it: rank {me} "
            f"waited in {recorder.describe(mine)}"
        )
    else:
        cause = (
            f"rank {me} waited in {recorder.describe(mine)}, which every "
            "rank of its group entered (the ranks may have issued other "
            "collectives, or in another order)"
        )
    lines = [
        f"Rank {me}: a collective timed out {waited}, and {cause}. The "
        "ranks are alive (their heartbeats beat) but stuck elsewhere."
    ]
    for rank, waits_for in chain.items():
        lines.append(
            f"Rank {rank} waits in "
            f"{recorder.describe(reports[rank]['recorder']['last'], now)} "
            f"for rank(s) {shared.names(waits_for)}, which never entered it."
        )
    for rank in stuck:
        rep = reports[rank]
        last = recorder.describe(rep["recorder"]["last"], now)
        lines.append(
            f"Rank {rank} last entered {last}; its Python stack (innermost "
            f"last):\n{shared.stack_text(rep)}"
        )
    silent = [r for r in _members(mine) if r not in reports]
    if silent:
        lines.append(
            f"Rank(s) {shared.names(silent)} beat but did not report where "
            "they are in time."
        )
    lines.append(
        shared.advice(
            f"rank(s) {shared.names(stuck) or '(none named)'}",
            "rank",
            "launch(collective_timeout=...) or "
            f"{elastic.COLLECTIVE_TIMEOUT_VARIABLE}",
            error,
            reported_line,
        )
    )
    return RankStuckError("\n\n".join(lines), ranks=stuck, rank=me)


def _waiting_for(record, reports):
    """The ranks of `record`'s group that never entered its collective."""
    group = record["group"]
    return [
        r
        for r in _members(record)
        if r in reports
        and reports[r]["recorder"]["counts"].get(group, 0) < record["number"]
    ]


def _members(record):
    return [int(r) for r in record["group"].split(",")]


def _waits(rep):
    return rep.get("in_collective", False)


def _follow(waiting, reports):
    """`(stuck ranks, {rank: ranks it waits for})` from `waiting`: a rank
    that waits in a collective of its own that others never entered is
    followed to them."""
    stuck, chain, seen = [], {}, set()
    queue = list(waiting)
    while queue:
        rank = queue.pop(0)
        if rank in seen:
            continue
        seen.add(rank)
        rep = reports[rank]
        last = rep["recorder"]["last"]
        behind = _waiting_for(last, reports) if last and _waits(rep) else []
        if behind:
            chain[rank] = behind
            queue.extend(behind)
        else:
            stuck.append(rank)
    return sorted(stuck), chain
