"""Gradient compression: loss against bytes, with and without warm-up.

Two parts share the data-parallel training of this file:

- `train()`: the demo's transformer LM on its counting sequences with 4
  data ranks (DDP, Adam); `benchmarks/local_sgd.py` runs it too.
- `main()`: the convergence grid behind `Compression`'s default warm-up.
  An MLP regression and the transformer LM, Adam and SGD with momentum,
  2 and 4 data ranks, on JAX's virtual devices: uncompressed training
  against PowerSGD (rank 1) and signs, each without warm-up and with the
  warm-ups asked for. Per run, the loss on the whole training set at the
  end, and the bytes handed to the data axis' collectives
  (`communication_stats(axis="data")`, read after every step) over the
  whole run and after the warm-up, as ratios to uncompressed training:

    KERAS_BACKEND=jax python benchmarks/gradient_compression.py \
        --steps 960 --warmups 0,100 --out benchmarks/results/NAME

writes `NAME.md` (the table) and `NAME.json` (every run).
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


# The grid of `main()`.
MODELS = ("mlp", "transformer")
OPTIMIZERS = ("adam", "sgd")
RANKS = (2, 4)
COMPRESSED = ("powersgd", "sign")
# Within this of the uncompressed loss, at most this of its bytes.
LOSS_TOLERANCE = 0.10
BYTES_TARGET = 0.25


def mlp_regression(samples=SAMPLES, seed=0):
    """An MLP and a regression task: a random tanh teacher's outputs."""
    import keras
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 32)).astype("float32")
    hidden = np.tanh(x @ rng.normal(size=(32, 64)) / np.sqrt(32))
    y = (hidden @ rng.normal(size=(64, 8)) / np.sqrt(8)).astype("float32")
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((32,))
    h = keras.layers.Dense(128, activation="relu")(inputs)
    h = keras.layers.Dense(128, activation="relu")(h)
    model = keras.Model(inputs, keras.layers.Dense(8)(h))
    return model, (x, y), "mse"


def transformer_task():
    """The demo's transformer LM (width 64) on its counting sequences."""
    import keras

    from keras_tp.demo.models import counting_sequences
    from keras_tp.demo.models import transformer_lm

    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model = transformer_lm(dim=64, heads=4, blocks=2)
    return model, counting_sequences(SAMPLES), loss


def inner_optimizer(name):
    """Adam(1e-3), or SGD(0.05) with momentum 0.9."""
    import keras

    if name == "adam":
        return keras.optimizers.Adam(1e-3)
    return keras.optimizers.SGD(0.05, momentum=0.9)


def compression_for(kind, warmup_steps, rank=None):
    """A kind's default `Compression` with the given warm-up (and
    PowerSGD's rank, if given)."""
    if kind is None:
        return None
    if kind == "powersgd":
        return keras_tp.Compression(kind, rank=rank, warmup_steps=warmup_steps)
    return keras_tp.Compression(kind, warmup_steps=warmup_steps)


def bytes_ledger():
    """A callback listing the data axis' optimizer bytes of every step.

    It reads `self.model`, which on JAX brings the step's variables back
    to the model first (the warm-up's flag among them).
    """
    import keras

    class Ledger(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.per_step = []

        def on_train_batch_end(self, batch, logs=None):
            stats = self.model.communication_stats(axis="data")
            self.per_step.append(
                sum(entry["optimizer_bytes"] for entry in stats.values())
            )

    return Ledger()


def grid_run(
    model_name, optimizer, ranks, kind, warmup_steps, steps, rank=None
):
    """One run of the grid: `{"loss", "bytes_per_step"}`."""
    make = mlp_regression if model_name == "mlp" else transformer_task
    model, (x, y), loss = make()
    tp = keras_tp.TensorParallelKeras(
        model, world_size=ranks, data_parallel=ranks
    )
    tp.compile(
        optimizer=keras_tp.CoordinatedOptimizer(
            inner_optimizer(optimizer),
            compression=compression_for(kind, warmup_steps, rank),
        ),
        loss=loss,
    )
    ledger = bytes_ledger()
    epochs = -(-steps // (SAMPLES // BATCH))
    tp.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[ledger],
    )
    final = tp.evaluate(x, y, batch_size=4 * BATCH, verbose=0)
    final = final[0] if isinstance(final, list) else final
    return {"loss": float(final), "bytes_per_step": ledger.per_step}


def summarised(run, baseline, warmup_steps):
    """A run's loss and bytes as ratios to the uncompressed `baseline`."""
    sent, plain = run["bytes_per_step"], baseline["bytes_per_step"]
    after = slice(min(warmup_steps, len(sent) - 1), None)
    return {
        "loss": run["loss"],
        "loss_ratio": run["loss"] / baseline["loss"],
        "bytes_ratio": sum(sent) / sum(plain),
        "bytes_ratio_after_warmup": sum(sent[after]) / sum(plain[after]),
    }


def meets_target(row):
    """Within `LOSS_TOLERANCE` of uncompressed at <= `BYTES_TARGET` bytes."""
    return (
        row["loss_ratio"] <= 1 + LOSS_TOLERANCE
        and row["bytes_ratio"] <= BYTES_TARGET
    )


def grid(steps, warmups, rank=None, models=MODELS, kinds=COMPRESSED):
    """Every run of the grid, summarised: a list of table rows."""
    rows = []
    for model_name in models:
        for optimizer in OPTIMIZERS:
            for ranks in RANKS:
                setting = (model_name, optimizer, ranks)
                baseline = grid_run(*setting, None, 0, steps)
                logger.info("%s none: loss %.4f", setting, baseline["loss"])
                for kind in kinds:
                    for warmup in warmups:
                        run = grid_run(*setting, kind, warmup, steps, rank)
                        row = summarised(run, baseline, warmup)
                        row.update(
                            model=model_name,
                            optimizer=optimizer,
                            ranks=ranks,
                            kind=kind,
                            warmup_steps=warmup,
                            uncompressed_loss=baseline["loss"],
                        )
                        logger.info("%s", row)
                        rows.append(row)
    return rows


def markdown(rows, steps):
    """The grid's rows as a Markdown table."""
    lines = [
        f"{steps} steps of batch {BATCH}; loss on the whole training set "
        "after the run; bytes as a ratio to uncompressed training's.",
        "",
        "| model | optimizer | ranks | kind | warm-up | loss | "
        "uncompressed | loss ratio | bytes, whole run | bytes, after "
        f"warm-up | within {LOSS_TOLERANCE:.0%} at <= {BYTES_TARGET}x |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['model']} | {row['optimizer']} | {row['ranks']} | "
            f"{row['kind']} | {row['warmup_steps']} | {row['loss']:.4f} | "
            f"{row['uncompressed_loss']:.4f} | {row['loss_ratio']:.3f} | "
            f"{row['bytes_ratio']:.3f} | "
            f"{row['bytes_ratio_after_warmup']:.3f} | "
            f"{'yes' if meets_target(row) else 'no'} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=960)
    parser.add_argument(
        "--warmups", default="0,100", help="comma-separated warm-up steps"
    )
    parser.add_argument("--rank", type=int, help="PowerSGD's rank")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--kinds", default=",".join(COMPRESSED))
    parser.add_argument("--out", help="write OUT.md and OUT.json")
    args = parser.parse_args(argv)
    if os.environ.get("KERAS_BACKEND", "jax") == "jax":
        keras_tp.configure_virtual_devices(max(RANKS))
    warmups = [int(w) for w in args.warmups.split(",")]
    rows = grid(
        args.steps,
        warmups,
        args.rank,
        args.models.split(","),
        args.kinds.split(","),
    )
    table = markdown(rows, args.steps)
    print(table)
    if args.out:
        with open(f"{args.out}.md", "w") as f:
            f.write(table)
        with open(f"{args.out}.json", "w") as f:
            json.dump({"steps": args.steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    main()
