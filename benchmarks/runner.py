"""Starts each task's worker process and collects what it measured."""

import json
import logging
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

from benchmarks.worker import PROGRESS_PREFIX

# A progress line of the worker; a backend may write to stdout too.
PROGRESS = re.compile(re.escape(PROGRESS_PREFIX) + r"([0-9.]+)\n?")
REPO = pathlib.Path(__file__).resolve().parents[1]

logger = logging.getLogger(__name__)


def run_task(task, log_path, on_progress=None):
    """Runs one task in a fresh Python process of its backend.

    Args:
        task: a task dict from `benchmarks.suite.tasks()`.
        log_path: file that receives the worker's stderr (backend logs,
            tracebacks).
        on_progress: optional callable taking the fraction of the task
            done, as the worker reports it.

    Returns:
        The task dict with `status` (`"ok"` or `"failed: ..."`),
        `wall_seconds`, and the worker's `rows` and `data`.
    """
    env = dict(os.environ)
    env["KERAS_BACKEND"] = task["backend"]
    # The worker and the torch ranks it spawns import `benchmarks` and
    # `keras_tp` from this checkout.
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), env.get("PYTHONPATH")) if p
    )
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    start = time.perf_counter()
    with (
        tempfile.TemporaryDirectory() as scratch,
        open(log_path, "w") as log,
    ):
        result_path = os.path.join(scratch, "result.json")
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.worker",
                json.dumps(task),
                result_path,
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        for line in process.stdout:
            fractions = PROGRESS.findall(line)
            if fractions and on_progress is not None:
                on_progress(float(fractions[-1]))
            log.write(PROGRESS.sub("", line))
        returncode = process.wait()
        outcome = dict(task, wall_seconds=time.perf_counter() - start)
        if returncode == 0 and os.path.exists(result_path):
            with open(result_path) as file:
                outcome.update(json.load(file), status="ok")
            return outcome
    outcome.update(status=f"failed: {_last_error(log_path)}", rows=[], data={})
    logger.warning(
        "Task '%s' failed (exit %s); its log: %s",
        task["label"],
        returncode,
        log_path,
    )
    return outcome


def _last_error(log_path):
    """The last line of a traceback in the log, as the failure's reason."""
    lines = [
        line.strip()
        for line in pathlib.Path(log_path).read_text().splitlines()
        if line.strip()
    ]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["no output"])[-1][:300]
