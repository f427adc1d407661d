"""Writes the supported-models table of `docs/models.md` from measurements.

Every keras-hub family of the test zoo (`tests/zoo.py`: tiny configs,
random weights, offline) is split with `plan="auto"` on the backend Keras
is set to, and measured against the same model on one device:

    KERAS_BACKEND=jax python -m benchmarks.model_zoo --world-size 2
    KERAS_BACKEND=jax python -m benchmarks.model_zoo --world-size 2 --write

`--write` replaces the table between the markers in `docs/models.md`.
On torch, run the same command under `torchrun --nproc-per-node 2`.
"""

import argparse
import collections
import os
import re
import sys

import keras

import keras_tp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(ROOT, "docs", "models.md")
BEGIN = "<!-- zoo table: begin -->"
END = "<!-- zoo table: end -->"


def plan_summary(results):
    """Counts of each style in the plan, e.g. `8 Column, 4 Row, 1 Vocab`."""
    counts = collections.Counter(
        re.sub(r"\(.*", "", style)
        + (" (gather)" if "gather_output=True" in style else "")
        + (" (slice)" if "input_is_parallel=False" in style else "")
        for style in results["plan"].values()
    )
    return ", ".join(f"{n} {style}" for style, n in sorted(counts.items()))


def collectives_summary(results):
    parts = []
    for kind, entry in sorted(results["collectives"].items()):
        name = kind.replace("_", "-")
        parts.append(f"{name} {entry['forward']} fwd / {entry['backward']} bwd")
    return "; ".join(parts)


def table(world_size, names):
    from tests import zoo_cases

    rows = [
        f"| family | plan at TP={world_size} | collectives per training step "
        "| bytes/device ÷ ideal | max weight diff after 2 SGD steps |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        try:
            results = zoo_cases.measure(name, world_size)
        except NotImplementedError as error:
            rows.append(f"| {name} | refused: {error} | | | |")
            continue
        rows.append(
            f"| {name} | {plan_summary(results)} | "
            f"{collectives_summary(results)} | "
            f"{results['bytes_ratio']:.3f} | {results['weights']:.1e} |"
        )
    return "\n".join(rows)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args(argv)
    sys.path.insert(0, ROOT)
    keras_tp.configure_virtual_devices(max(args.world_size, 2))
    from tests import zoo_cases

    text = table(args.world_size, zoo_cases.TRANSFORMERS)
    backend = keras.backend.backend()
    text = f"Measured on {backend}, TP={args.world_size}:\n\n" + text
    if args.write:
        with open(PAGE) as f:
            page = f.read()
        start = page.index(BEGIN) + len(BEGIN)
        page = page[:start] + "\n" + text + "\n" + page[page.index(END) :]
        with open(PAGE, "w") as f:
            f.write(page)
    print(text)


if __name__ == "__main__":
    main()
