"""A pytest plugin that records each test's CPU time, to see what makes
the suite slow on few cores (where CPU, not waiting, sets its length).

    KERAS_TP_CPU_TIMES=/tmp/cpu.jsonl \\
        PYTEST_ADDOPTS="-p tests.cpu_times" bash tests/run_all.sh

Each test appends one JSON line to the file: its id, its backend, the
xdist worker that ran it, when it started, its wall seconds, the CPU
seconds of its test process (every thread, JAX's and XLA's included) and
of the child processes it waited for (subprocesses, notebook kernels,
TensorFlow's worker scripts). The
processes that `keras_tp.launch` forks for torch's ranks belong to the
fork server, and Ray's to Ray's daemons: neither is counted.
"""

import json
import os
import resource
import time

import pytest

_PATH_VARIABLE = "KERAS_TP_CPU_TIMES"


def _cpu_seconds(who):
    usage = resource.getrusage(who)
    return usage.ru_utime + usage.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    path = os.environ.get(_PATH_VARIABLE)
    if not path:
        yield
        return
    started = time.time()
    start = time.perf_counter()
    own = _cpu_seconds(resource.RUSAGE_SELF)
    children = _cpu_seconds(resource.RUSAGE_CHILDREN)
    yield
    record = {
        "test": item.nodeid,
        "backend": os.environ.get("KERAS_BACKEND"),
        # Which pytest-xdist worker ran it, and when it started (Unix
        # seconds): how the phases' workers fill the cores over time.
        "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
        "started": started,
        "wall": time.perf_counter() - start,
        "cpu": _cpu_seconds(resource.RUSAGE_SELF) - own,
        "children_cpu": _cpu_seconds(resource.RUSAGE_CHILDREN) - children,
    }
    # Two xdist workers append to the same file: one write per line.
    with open(path, "a") as file:
        file.write(json.dumps(record) + "\n")
