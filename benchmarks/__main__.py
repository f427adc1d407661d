"""`python -m benchmarks`: runs the suite of issue #14 and writes its record.

    python -m benchmarks                      # every item, ~20 min on 2 cores
    python -m benchmarks --only 1,5           # items 1 and 5
    python -m benchmarks --quick --out /tmp/b # smoke-test sizes, seconds

Writes `<date>-<device>.json`, `.md` and the plots of items 7 and 8 into
`--out` (default `benchmarks/results/`), and prints the table.
"""

import argparse
import logging
import os
import pathlib
import shlex
import sys
import tempfile
import time

from benchmarks import report
from benchmarks import runner
from benchmarks import suite

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="keras_tp against what users would pick instead: "
        "step time, memory and communication, as ratios measured in one run.",
    )
    parser.add_argument(
        "--only",
        type=lambda text: [int(n) for n in text.split(",") if n.strip()],
        help="comma-separated item numbers, e.g. 1,5 (default: all)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny sizes and one or two rounds: checks that the suite runs",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="directory of the results (default: benchmarks/results, or a "
        "temporary directory with --quick)",
    )
    return parser.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # The progress bar is Keras'; this process computes nothing, so it
    # takes the lightest backend (each task picks its own).
    os.environ.setdefault("KERAS_BACKEND", "numpy")
    import keras

    tasks = suite.tasks(args.only, quick=args.quick)
    out_dir = args.out or (
        tempfile.mkdtemp(prefix="keras_tp_benchmarks_")
        if args.quick
        else RESULTS
    )
    log_dir = pathlib.Path(tempfile.mkdtemp(prefix="keras_tp_benchmark_logs_"))
    progress = keras.utils.Progbar(len(tasks), unit_name="task")
    outcomes = []
    start = time.perf_counter()
    for index, task in enumerate(tasks):
        print(f"item {task['item']}: {task['label']}", flush=True)
        outcomes.append(
            runner.run_task(
                task,
                log_dir / f"{index:02d}-item{task['item']}.log",
                on_progress=lambda f, i=index: progress.update(i + f),
            )
        )
        progress.update(index + 1)
    titles = {t["item"]: suite.ITEMS[t["item"]].title for t in tasks}
    doc = report.document(
        outcomes,
        command=shlex.join(["python", "-m", "benchmarks", *argv]),
        quick=args.quick,
        wall_seconds=time.perf_counter() - start,
        titles=titles,
    )
    paths = report.write(doc, out_dir)
    print()
    print(report.markdown(doc))
    for path in paths:
        print(f"wrote {path}")
    failed = [o["label"] for o in outcomes if o["status"] != "ok"]
    if failed:
        print(f"failed: {', '.join(failed)}; logs in {log_dir}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
