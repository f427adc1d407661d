"""Local SGD and DiLoCo: bytes per step against loss, against DDP.

Trains the demo's transformer LM on its counting sequences with 4 data
ranks (Adam) once per configuration: DDP, local SGD synchronising every
`H` steps, and DiLoCo (an outer Nesterov SGD at each synchronisation).
Prints a Markdown table of the bytes a synchronisation hands to the data
axis (from `communication_stats()` after the last step, which
synchronises), the bytes per step over the run, and the loss. Run it on
JAX, whose virtual devices make it quick:

    KERAS_BACKEND=jax python benchmarks/local_sgd.py [--steps 320]
"""

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras_tp  # noqa: E402
from benchmarks import gradient_compression  # noqa: E402

logger = logging.getLogger(__name__)

DATA_PARALLEL = gradient_compression.DATA_PARALLEL
BATCH = gradient_compression.BATCH
SAMPLES = gradient_compression.SAMPLES
# (name, local_sgd_steps, whether an outer Nesterov SGD steps the anchor)
CONFIGURATIONS = [
    ("DDP", None, False),
    ("local SGD, H = 4", 4, False),
    ("local SGD, H = 16", 16, False),
    ("DiLoCo, H = 4", 4, True),
    ("DiLoCo, H = 16", 16, True),
]


def train(local_sgd_steps, diloco, steps, dim):
    """Per-epoch losses and the bytes of a synchronisation of one run."""
    import keras

    outer = (
        keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)
        if diloco
        else None
    )
    return gradient_compression.train(
        steps, dim, local_sgd_steps=local_sgd_steps, outer_optimizer=outer
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=320)
    parser.add_argument("--dim", type=int, default=64)
    args = parser.parse_args(argv)
    if os.environ.get("KERAS_BACKEND", "jax") == "jax":
        keras_tp.configure_virtual_devices(DATA_PARALLEL)
    epoch = SAMPLES // BATCH
    lines = [
        "| configuration | bytes per synchronisation | bytes per step "
        f"| loss after {2 * epoch} steps | loss after "
        f"{args.steps // epoch * epoch} steps |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, local_sgd_steps, diloco in CONFIGURATIONS:
        losses, sent = train(local_sgd_steps, diloco, args.steps, args.dim)
        per_step = sent / (local_sgd_steps or 1)
        logger.info("%s: %d bytes, loss %.4f", name, sent, losses[-1])
        lines.append(
            f"| {name} | {sent:,} | {per_step:,.0f} | "
            f"{losses[min(1, len(losses) - 1)]:.3f} | {losses[-1]:.3f} |"
        )
    print("\n".join(lines))


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
