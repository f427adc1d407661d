"""Where a live but stuck rank is, for the error of a timed-out collective.

A rank that is alive but stuck (a hung data loader, a deadlock, a long
computation on one rank only) keeps its heartbeat beating, so no liveness
check finds it lost when another rank's collective times out. The rank
whose collective timed out then asks the others for a `report`: its
flight-recorder counts (`keras_tp.collectives.recorder`), its main
thread's Python stack, and whether that thread waits in a collective now.
A thread of each rank answers while its main thread waits or sleeps.

The backends share this module: torch ranks answer through the
rendezvous store (`keras_tp.runtime.torch.stuck`, which compares the
counts), TensorFlow workers through the coordination service's key-value
store (`keras_tp.runtime.tensorflow.liveness`).
"""

import sys
import threading
import traceback

from keras_tp.collectives import recorder

# The innermost frames of a stack that a report carries.
STACK_FRAMES = 20
# The innermost frames that decide whether the main thread is inside a
# collective (or a compiled step that runs them).
_INNERMOST = 3


def report(request, collective_files):
    """This process's answer to `request`: counts, last collective, stack.

    Args:
        request: what the asking rank sent, returned as is so that it can
            tell this answer from an older one.
        collective_files: parts of file paths (`"torch/distributed/"`)
            whose frames, among the innermost of the main thread, mean
            that it waits in a collective.

    Returns:
        A JSON-able dict: `request`, `recorder` (`recorder.snapshot()`),
        `stack` (text, innermost last) and `in_collective`.
    """
    frame = sys._current_frames().get(threading.main_thread().ident)
    frames = traceback.extract_stack(frame) if frame is not None else []
    files = [f.filename.replace("\\", "/") for f in frames[-_INNERMOST:]]
    return {
        "request": request,
        "recorder": recorder.snapshot(),
        "stack": "".join(traceback.format_list(frames[-STACK_FRAMES:])),
        "in_collective": any(
            marker in name for name in files for marker in collective_files
        ),
    }


def names(ranks):
    """`"1, 3"` for ranks `[3, 1]`."""
    return ", ".join(map(str, sorted(ranks)))


def stack_text(rep):
    """The stack of a report, without its trailing newline."""
    return rep.get("stack", "").rstrip()


def advice(stuck, member, raise_timeout, error, reported_line):
    """The closing paragraph of a stuck-rank error: what to look for.

    Args:
        stuck: the stuck ranks' names, e.g. `"rank(s) 1"`.
        member: what a rank is called: `"rank"`, `"worker"`.
        raise_timeout: how to give collectives more time.
        error: the backend's error.
        reported_line: the line of its message that says what it saw.
    """
    return (
        f"Find what holds {stuck} there (a data loader, a lock, code that "
        f"runs on some {member}s only): every {member} must issue the same "
        "collectives in the same order. If they only take longer, raise "
        f"{raise_timeout}. The collective's error: {type(error).__name__}: "
        f"{reported_line}."
    )
