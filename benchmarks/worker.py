"""Runs one benchmark task in a process of its own backend.

Keras reads `KERAS_BACKEND` once, at import, and JAX and TensorFlow fix
their number of virtual devices when they start, so every task runs in a
fresh process:

    python -m benchmarks.worker '<task as JSON>' RESULT.json

The task names the backend, the virtual devices, and the function
(`"module:name"`) to call with its keyword arguments and a `progress`
callable. The function returns a JSON-able dict, written to RESULT.json.
Progress goes to stdout as lines `@@progress <fraction>`, which the suite
turns into its progress bar; everything else a backend prints goes to
stderr.
"""

import importlib
import json
import os
import sys

PROGRESS_PREFIX = "@@progress "


def report_progress(fraction):
    """Tells the suite how much of this task is done (0 to 1)."""
    # One write per line, so that lines of two threads never interleave.
    sys.stdout.write(f"{PROGRESS_PREFIX}{min(max(fraction, 0.0), 1.0):.4f}\n")
    sys.stdout.flush()


def run_task(task):
    """Sets the backend and devices up, then calls the task's function."""
    os.environ["KERAS_BACKEND"] = task["backend"]
    import keras_tp

    if task.get("devices") and task["backend"] != "torch":
        keras_tp.configure_virtual_devices(task["devices"])
    module_name, function_name = task["function"].split(":")
    function = getattr(importlib.import_module(module_name), function_name)
    return function(progress=report_progress, **task["kwargs"])


def main(argv):
    task = json.loads(argv[0])
    result = run_task(task)
    with open(argv[1], "w") as file:
        json.dump(result, file, indent=1, default=_to_builtin)


def _to_builtin(value):
    # NumPy and JAX scalars reach the results through measured values.
    if hasattr(value, "item"):
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"Cannot write {type(value)} to JSON.")


if __name__ == "__main__":
    main(sys.argv[1:])
