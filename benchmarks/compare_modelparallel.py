"""keras_tp against Keras' own ModelParallel on JAX: item 1 of the suite.

    python benchmarks/compare_modelparallel.py --devices 4

Trains the suite's GPT-style LM split the same way by keras_tp and by
`keras.distribution.ModelParallel` given `plan.to_layout_map()`, on
`--devices` virtual CPU devices, and prints the comparison: step time and
the first two `fit()` epochs (compilation) as interleaved ratios, the peak
memory of the compiled step, the collectives in the compiled HLO and the
bytes each device stores. `python -m benchmarks --only 1` runs the same at
TP=2 and 4 and keeps the record in `benchmarks/results/`.
"""

import argparse
import json
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from benchmarks import runner  # noqa: E402
from benchmarks import suite  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    (task, *_) = suite.tasks([1], quick=args.quick)
    task["devices"] = task["kwargs"]["tensor_parallel"] = args.devices
    task["label"] = f"JAX TP={args.devices} vs ModelParallel"
    with tempfile.NamedTemporaryFile(suffix=".log") as log:
        outcome = runner.run_task(task, log.name)
        if outcome["status"] != "ok":
            print(pathlib.Path(log.name).read_text()[-3000:], file=sys.stderr)
            sys.exit(outcome["status"])
    print("| what | against | measured | IQR |")
    print("|---|---|---|---|")
    for row in outcome["rows"]:
        print(
            f"| {row['what']} | {row['against']} | {row['median']:.3f}x "
            f"| {row['q1']:.3f}-{row['q3']:.3f} |"
        )
    data = outcome["data"]
    print()
    print(json.dumps({k: data[k] for k in _DETAILS}, indent=1))


_DETAILS = (
    "model",
    "train_step_compiles_in_3_fits",
    "first_epoch_loss_difference",
    "hlo_collectives",
    "step_memory",
    "stored_bytes_largest_device",
)

if __name__ == "__main__":
    main()
