"""Which collective this process last entered: a small flight recorder.

Every collective a process-rank adapter issues (torch) is entered here
first (`CollectiveAdapter._enter`): a sequence number per process group,
counted alike on every rank of the group because every rank issues the
same collectives in the same order, and a description of the last one.
When a collective times out, the ranks whose number for its group is
lower never entered it: they are the stuck ones. This is what torch's
desync debugging (`TORCH_DISTRIBUTED_DEBUG=DETAIL`) and NCCL's flight
recorder record; here it costs a dictionary update per collective, and
the records travel only when a failure asks for them
(`keras_tp.runtime.torch.liveness`).
"""

import threading
import time

_LOCK = threading.Lock()
# `{group key: number of collectives entered}`; a group key is its global
# ranks, "0,1".
_COUNTS = {}
_LAST = None


def enter(group, kind, shape, dtype, axis=None, phase=None, direction=None):
    """Records that this process enters a collective.

    Args:
        group: the group's key, its global ranks joined by commas.
        kind: "all_reduce", "all_gather", ...
        shape: the shape of this rank's input, a tuple.
        dtype: its dtype, as text.
        axis: the mesh axis the collective runs over.
        phase: the step it belongs to ("train", "test", ...), if any.
        direction: "forward", "backward" or "optimizer", if known.
    """
    global _LAST
    with _LOCK:
        number = _COUNTS.get(group, 0) + 1
        _COUNTS[group] = number
        _LAST = {
            "group": group,
            "number": number,
            "kind": kind,
            "shape": list(shape),
            "dtype": dtype,
            "axis": axis,
            "phase": phase,
            "direction": direction,
            "time": time.time(),
        }


def snapshot():
    """`{"counts": {group: number}, "last": record or None}`, a copy."""
    with _LOCK:
        return {"counts": dict(_COUNTS), "last": dict(_LAST or {}) or None}


def reset():
    """Forgets every record (a process that leaves its group)."""
    global _LAST
    with _LOCK:
        _COUNTS.clear()
        _LAST = None


def describe(record, now=None):
    """One line for a record of `enter`, e.g. "all_reduce #7 over ranks
    [0, 1] (axis model, train step, backward, float32 (8, 16))"."""
    if not record:
        return "no collective yet"
    details = [
        f"axis {record['axis']}" if record.get("axis") else None,
        f"{record['phase']} step" if record.get("phase") else None,
        record.get("direction"),
        f"{record['dtype']} {tuple(record['shape'])}",
    ]
    if now is not None:
        details.append(f"{max(0.0, now - record['time']):.1f} s ago")
    return (
        f"{record['kind']} #{record['number']} over ranks "
        f"[{record['group'].replace(',', ', ')}] "
        f"({', '.join(d for d in details if d)})"
    )
