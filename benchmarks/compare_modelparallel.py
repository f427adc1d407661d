"""keras_tp against Keras' own ModelParallel (GSPMD), on the same sharding.

Trains one transformer LM three ways on the JAX backend: on one device,
with `keras_tp.TensorParallelKeras`, and with
`keras.distribution.ModelParallel` given `plan.to_layout_map()` (the same
split of every variable, left to XLA's GSPMD partitioner). It prints, as
Markdown tables:

- the loss after each epoch (the three should agree to float32 rounding);
- parameter bytes per device, read from the arrays' `addressable_shards`;
- the collectives in the compiled training step (operands of each HLO
  collective, since XLA may combine several into one op);
- the time of one training step, relative to one device, measured in this
  run. On virtual CPU devices, all ranks share the machine's cores, so the
  ratio measures overhead, not the speed-up real accelerators would give.

Run:

    python benchmarks/compare_modelparallel.py --devices 4
    python benchmarks/compare_modelparallel.py --devices 4 --model gpt2 \
        --dim 256 --heads 4 --vocab 1024

`--model gpt2` trains keras-hub's `GPT2CausalLM` (tied embeddings, built
offline with random weights) with the plan `plan="auto"` gives it.
"""

import argparse
import os
import re
import statistics
import time
from contextlib import nullcontext

os.environ["KERAS_BACKEND"] = "jax"

import keras_tp  # noqa: E402

HLO_COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument(
        "--model", choices=("transformer_lm", "gpt2"), default="transformer_lm"
    )
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=9)
    return parser.parse_args()


def main():
    args = parse_args()
    keras_tp.configure_virtual_devices(args.devices)
    import jax
    import keras

    from keras_tp.demo.models import counting_sequences
    from keras_tp.demo.models import transformer_lm

    def build():
        if args.model == "gpt2":
            import keras_hub

            keras.utils.set_random_seed(0)
            backbone = keras_hub.models.GPT2Backbone(
                vocabulary_size=args.vocab,
                num_layers=args.blocks,
                num_heads=args.heads,
                hidden_dim=args.dim,
                intermediate_dim=4 * args.dim,
                max_sequence_length=args.seq_len,
                dropout=0.0,
            )
            return keras_hub.models.GPT2CausalLM(
                backbone=backbone, preprocessor=None
            )
        return transformer_lm(
            vocab=args.vocab,
            seq_len=args.seq_len,
            dim=args.dim,
            heads=args.heads,
            blocks=args.blocks,
        )

    def compile_model(model):
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=None,
        )

    x, y = counting_sequences(
        args.batch * args.steps, vocab=args.vocab, seq_len=args.seq_len
    )
    if args.model == "gpt2":
        x = {"token_ids": x, "padding_mask": (x >= 0).astype("int32")}
    fit_args = dict(x=x, y=y, batch_size=args.batch, shuffle=False, verbose=0)

    single = build()
    tp = keras_tp.TensorParallelKeras(build(), world_size=args.devices)
    mesh = keras.distribution.DeviceMesh(
        (1, args.devices),
        ["batch", "model"],
        devices=keras.distribution.list_devices()[: args.devices],
    )
    gspmd = keras.distribution.ModelParallel(
        layout_map=tp.sharding_plan.to_layout_map(mesh),
        batch_dim_name="batch",
    )
    with gspmd.scope():
        model_parallel = build()
    runs = {
        "one device": (single, None),
        f"keras_tp TP={args.devices}": (tp, None),
        f"ModelParallel TP={args.devices}": (model_parallel, gspmd),
    }

    losses, collectives, memory = {}, {}, {}
    for name, (model, distribution) in runs.items():
        with _scope(distribution):
            compile_model(model)
            history = model.fit(epochs=args.epochs, **fit_args).history
            losses[name] = history["loss"]
            collectives[name] = _hlo_collectives(jax, model, x, y, args.batch)
        memory[name] = _bytes_per_device(model.variables)
    # Time the compiled steps round-robin, so that a burst of load on the
    # machine slows every model alike, and keep the median.
    times = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, (model, distribution) in runs.items():
            with _scope(distribution):
                start = time.perf_counter()
                model.fit(epochs=1, **fit_args)
                times[name].append((time.perf_counter() - start) / args.steps)
    step_times = {name: statistics.median(t) for name, t in times.items()}

    print(
        f"{args.model}: dim {args.dim}, {args.heads} heads, "
        f"{args.blocks} blocks, vocab {args.vocab}, sequence {args.seq_len}, "
        f"batch {args.batch}; {args.devices} virtual CPU devices "
        f"({os.cpu_count()} cores); jax {jax.__version__}, "
        f"keras {keras.__version__}\n"
    )
    names = list(runs)
    print("| epoch | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for epoch in range(args.epochs):
        row = " | ".join(f"{losses[n][epoch]:.6f}" for n in names)
        print(f"| {epoch + 1} | {row} |")

    print("\n| | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    print(
        "| parameter bytes, largest device | "
        + " | ".join(f"{max(memory[n].values()):,}" for n in names)
        + " |"
    )
    for op in HLO_COLLECTIVES:
        print(
            f"| `{op}` tensors in the compiled step | "
            + " | ".join(str(collectives[n][op]) for n in names)
            + " |"
        )
    base = step_times["one device"]
    print(
        f"| step time / one device's (median of {args.repeats}) | "
        + " | ".join(f"{step_times[n] / base:.2f}" for n in names)
        + " |"
    )


def _scope(distribution):
    return distribution.scope() if distribution else nullcontext()


def _bytes_per_device(variables):
    totals = {}
    for variable in variables:
        for shard in variable.value.addressable_shards:
            device = str(shard.device)
            totals[device] = totals.get(device, 0) + shard.data.nbytes
    return totals


def _hlo_collectives(jax, model, x, y, batch):
    """Tensors each HLO collective moves in the compiled training step.

    XLA may merge independent collectives into one op with several
    operands, so operands are counted, not ops.
    """
    import keras

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    hlo = (
        jax.jit(model.train_step)
        .lower(
            state,
            (keras.tree.map_structure(lambda a: a[:batch], x), y[:batch]),
        )
        .compile()
        .as_text()
    )
    counts = {}
    for op in HLO_COLLECTIVES:
        calls = re.findall(rf"\s{op}(?:-start)?\(([^)]*)\)", hlo)
        counts[op] = sum(operands.count("%") for operands in calls)
    return counts


if __name__ == "__main__":
    main()
