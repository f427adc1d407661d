"""Interleaved timing: every speed figure is a ratio measured in one run.

Two programs timed minutes apart on a shared machine differ by whatever
else the machine was doing. Timed round-robin, a burst of load slows the
candidates of the same round alike, so the ratio of their times within a
round cancels most of it. The figures kept are the median of the per-round
ratios and their interquartile range.
"""

import statistics
import time


def interleaved(candidates, repeats, warmup=0, progress=None):
    """Times each candidate once per round, for `repeats` rounds.

    The order of the candidates rotates from round to round, so that none
    always runs first (after a pause) or last.

    Args:
        candidates: `{name: callable}`; one call is one timed repetition.
            A callable may return a number of seconds itself (a step time
            it measured inside, say); otherwise its wall time is taken.
        repeats: number of timed rounds.
        warmup: untimed rounds run first (compilation, caches).
        progress: optional callable taking the fraction of rounds done.

    Returns:
        `{name: [seconds per round]}`.
    """
    names = list(candidates)
    times = {name: [] for name in names}
    for round_index in range(warmup + repeats):
        shift = round_index % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.perf_counter()
            measured = candidates[name]()
            elapsed = time.perf_counter() - start
            if round_index >= warmup:
                times[name].append(
                    elapsed if measured is None else float(measured)
                )
        if progress is not None:
            progress((round_index + 1) / (warmup + repeats))
    return times


def spread(values):
    """`{"median", "q1", "q3", "repeats"}` of a list of numbers."""
    values = sorted(values)
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {
        "median": statistics.median(values),
        "q1": q1,
        "q3": q3,
        "repeats": len(values),
    }


def ratio(times, numerator, denominator):
    """Median and spread of `numerator / denominator`, round by round.

    Args:
        times: what `interleaved` returned.
        numerator: name of the candidate measured.
        denominator: name of the candidate it is compared with.

    Returns:
        `spread()` of the per-round ratios, with the median seconds of each
        side as `numerator_s` and `denominator_s`.
    """
    ratios = [a / b for a, b in zip(times[numerator], times[denominator])]
    result = spread(ratios)
    result["numerator_s"] = statistics.median(times[numerator])
    result["denominator_s"] = statistics.median(times[denominator])
    return result


def comparison(what, against, measured, goal=None, unit="x", note=""):
    """One row of the results table.

    Args:
        what: what keras_tp ran, e.g. `"keras_tp TP=2 step"`.
        against: what it is compared with.
        measured: a `spread()`/`ratio()` dict, or a plain number.
        goal: `None` (report only) or `(op, bound)` with op `"<="`, `">="`
            or `"=="` applied to the median, or `"within"`: the median is
            within `bound` (a fraction) of 1.
        unit: how the value reads: `"x"` for a ratio.
        note: one sentence of context.

    Returns:
        A dict ready for JSON.
    """
    if not isinstance(measured, dict):
        measured = spread([measured])
    row = {
        "what": what,
        "against": against,
        "unit": unit,
        **measured,
        "goal": None,
        "met": None,
        "note": note,
    }
    if goal is not None:
        op, bound = goal
        value = measured["median"]
        met = {
            "<=": value <= bound,
            ">=": value >= bound,
            "==": abs(value - bound) <= 1e-9 * max(1.0, abs(bound)),
            "within": abs(value - 1.0) <= bound,
        }[op]
        row["goal"] = (
            f"1 ± {bound:.0%}" if op == "within" else f"{op} {bound:g}"
        )
        row["met"] = bool(met)
    return row
