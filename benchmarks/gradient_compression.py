"""Gradient compression: bytes per step against loss, kind by kind.

Trains the demo's transformer LM on its counting sequences with 4 data
ranks (DDP, Adam) once per compression kind, and prints a Markdown table
of the bytes each step hands to the data axis' collectives (from
`communication_stats()`) and the loss after the run, next to uncompressed
training. Run it on JAX, whose virtual devices make it quick:

    KERAS_BACKEND=jax python benchmarks/gradient_compression.py [--steps 300]

`--json PATH` also writes the per-epoch losses (the notebook
`notebooks/06_compression.ipynb` plots them).
"""

import argparse
import json
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras_tp  # noqa: E402

logger = logging.getLogger(__name__)

DATA_PARALLEL = 4
BATCH = 32
SAMPLES = 1024
KINDS = [
    ("none", None),
    ("bf16", "bf16"),
    ("fp16", "fp16"),
    ("powersgd rank 1", keras_tp.Compression("powersgd", rank=1)),
    ("powersgd rank 4", keras_tp.Compression("powersgd", rank=4)),
    ("sign", "sign"),
]


def train(steps, dim, **options):
    """Per-epoch losses and the data axis' bytes in the last step of one
    run, with a `CoordinatedOptimizer` of Adam and `options`."""
    import keras

    from keras_tp.demo.models import counting_sequences
    from keras_tp.demo.models import transformer_lm

    x, y = counting_sequences(SAMPLES)
    tp = keras_tp.TensorParallelKeras(
        transformer_lm(dim=dim, heads=4, blocks=2),
        world_size=DATA_PARALLEL,
        data_parallel=DATA_PARALLEL,
    )
    optimizer = keras_tp.CoordinatedOptimizer(
        keras.optimizers.Adam(3e-3), **options
    )
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    tp.compile(optimizer=optimizer, loss=loss)
    epochs = steps // (SAMPLES // BATCH)
    history = tp.fit(
        x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0
    )
    stats = tp.communication_stats(axis="data")
    sent = sum(entry["optimizer_bytes"] for entry in stats.values())
    return history.history["loss"], sent


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=320)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--json", help="also write the results here")
    args = parser.parse_args(argv)
    if os.environ.get("KERAS_BACKEND", "jax") == "jax":
        keras_tp.configure_virtual_devices(DATA_PARALLEL)
    results = {}
    for name, compression in KINDS:
        losses, sent = train(args.steps, args.dim, compression=compression)
        results[name] = {"losses": losses, "bytes_per_step": sent}
        logger.info("%s: %d bytes, loss %.4f", name, sent, losses[-1])
    epoch = SAMPLES // BATCH
    steps = len(results["none"]["losses"]) * epoch
    baseline = results["none"]
    lines = [
        "| kind | bytes per step | vs none "
        f"| loss after {2 * epoch} steps | loss after {steps} steps |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, result in results.items():
        ratio = baseline["bytes_per_step"] / result["bytes_per_step"]
        losses = result["losses"]
        lines.append(
            f"| {name} | {result['bytes_per_step']:,} | {ratio:.1f}x | "
            f"{losses[min(1, len(losses) - 1)]:.3f} | {losses[-1]:.3f} |"
        )
    print("\n".join(lines))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
