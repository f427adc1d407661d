"""Runs the GPU benchmark: `python -m benchmarks.gpu [--cpu-smoke]`.

See `benchmarks/gpu/__init__.py` for what it measures.
"""

import argparse
import datetime
import json
import logging
import pathlib
import re
import sys
import tempfile
import time

from benchmarks import report
from benchmarks import runner
from benchmarks.gpu import tasks

logger = logging.getLogger(__name__)
RESULTS = pathlib.Path(__file__).resolve().parents[1] / "results"


def run_all(task_list, scratch):
    """Every task's outcome, each in its own worker process."""
    outcomes = []
    for index, task in enumerate(task_list):
        logger.info("%s ...", task["label"])
        log = pathlib.Path(scratch) / f"task{index}.log"
        outcome = runner.run_task(task, str(log))
        logger.info("%s: %s", task["label"], outcome["status"])
        if outcome["status"] != "ok":
            logger.error("Its log ends:\n%s", log.read_text()[-3000:])
        outcomes.append(outcome)
    return outcomes


def measure(smoke, backends, scratch):
    """One process per backend (measuring nothing where it sees no GPU,
    but in smoke mode), then TensorFlow's two logical devices.

    Returns:
        `({backend: GPU name or None}, outcomes)`.
    """
    sizes = tasks.SIZES["smoke" if smoke else "gpu"]
    outcomes = run_all(
        [tasks.backend_task(b, sizes, smoke) for b in backends], scratch
    )
    seen = {o["backend"]: o.get("data", {}).get("gpu") for o in outcomes}
    if "tensorflow" in backends and (smoke or seen.get("tensorflow")):
        outcomes += run_all([tasks.logical_devices_task(sizes)], scratch)
    return seen, outcomes


def device_name(gpu, smoke):
    """The device in file names: the GPU's name in lower case, dashed."""
    if smoke or gpu is None:
        return report.device_name(report.machine()) + (
            "-smoke" if smoke else ""
        )
    return re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")


def document(seen, outcomes, smoke, command, wall_seconds):
    """The run's record, a JSON-able dict."""
    gpu = next((name for name in seen.values() if name), None)
    return {
        "date": datetime.date.today().isoformat(),
        "device": device_name(gpu, smoke),
        "gpu": gpu,
        "gpu_seen_by": seen,
        "smoke": smoke,
        "machine": report.machine(),
        "versions": report.versions(),
        "command": command,
        "wall_seconds": wall_seconds,
        "tasks": outcomes,
    }


def markdown(doc):
    """The record as a Markdown table, one row per comparison."""
    seen = ", ".join(
        f"{b}: {g or 'no GPU'}" for b, g in doc["gpu_seen_by"].items()
    )
    lines = [
        f"Measured {doc['date']} on {doc['gpu'] or 'no GPU'} "
        f"(`{doc['device']}`; {seen}); `{doc['command']}`, "
        f"{doc['wall_seconds'] / 60:.1f} min."
        + (" CPU smoke sizes: not a measurement." if doc["smoke"] else ""),
        "",
        "| task | what | against | measured | range | goal | met |",
        "|---|---|---|---|---|---|---|",
    ]
    for task in doc["tasks"]:
        if task["status"] != "ok":
            lines.append(f"| {task['label']} | | | {task['status']} | | | no |")
        for row in task.get("rows", []):
            lines.append(markdown_row(row.get("part", task["label"]), row))
    return "\n".join(lines) + "\n"


def markdown_row(label, row):
    value = f"{row['median']:.4g} {row['unit']}".strip()
    spread = (
        f"{row['q1']:.4g}–{row['q3']:.4g} ({row['repeats']} rounds)"
        if row["repeats"] > 1
        else ""
    )
    met = {True: "yes", False: "**no**", None: ""}[row["met"]]
    return (
        f"| {label} | {row['what']} | {row['against']} | {value} | {spread} "
        f"| {row['goal'] or 'report'} | {met} |"
    )


def write(doc, out_dir):
    """Writes `<date>-<device>.json` and `.md`; returns their paths."""
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"{doc['date']}-{doc['device']}"
    paths = [stem.with_suffix(".json"), stem.with_suffix(".md")]
    paths[0].write_text(json.dumps(doc, indent=1) + "\n")
    paths[1].write_text(markdown(doc))
    return paths


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--cpu-smoke",
        action="store_true",
        help="the same code on the CPU at tiny sizes, in seconds",
    )
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--backends", default=",".join(tasks.BACKENDS))
    args = parser.parse_args(argv)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        seen, outcomes = measure(
            args.cpu_smoke, args.backends.split(","), scratch
        )
    command = "python -m benchmarks.gpu " + " ".join(argv or sys.argv[1:])
    doc = document(
        seen, outcomes, args.cpu_smoke, command, time.perf_counter() - start
    )
    for path in write(doc, args.out):
        print(path)
    failed = [o["label"] for o in outcomes if o["status"] != "ok"]
    if failed:
        logger.error("Failed: %s", failed)
        sys.exit(1)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    main()
