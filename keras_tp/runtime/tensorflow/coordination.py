"""Python objects exchanged between TensorFlow workers.

A `MultiWorkerMirroredStrategy` runs TensorFlow's coordination service,
whose key-value store every worker reaches. `gathered` lets the workers of
a job hand one another small JSON-like values (a checkpoint's lists of
pieces) through it, as torch's `all_gather_object` does, so that each
worker may save into a directory of its own (Ray Train merges them).
"""

import itertools
import json

# Private: the coordination service's key-value store has no public API.
from tensorflow.python.eager import context

# How long a worker waits for another's value: as long as a collective
# would (a worker still saving its pieces), up to 10 minutes.
_WAIT_MS = 10 * 60 * 1000
# Each call's keys: every worker makes the same calls in the same order.
_CALLS = itertools.count()


def gathered(value, process, processes):
    """Every worker's `value`, in process order.

    Args:
        value: this worker's value, JSON-like.
        process: this worker's index.
        processes: the number of workers.

    Returns:
        A list of `processes` values.
    """
    store = context.context()
    call = next(_CALLS)
    store.set_config_key_value(_key(call, process), json.dumps(value))
    values = [
        json.loads(store.get_config_key_value(_key(call, other), _WAIT_MS))
        for other in range(processes)
    ]
    # Every worker has now published this call, so each has read the
    # previous one: its value can go.
    if call:
        store.delete_config_key_value(_key(call - 1, process))
    return values


def _key(call, process):
    return f"keras_tp/objects/{call}/{process}"
