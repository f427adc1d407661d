"""Activation memory with and without sequence parallelism, on JAX.

Compiles the training step of a GPT-style keras-hub backbone (hidden 512,
4 heads, 2 blocks by default) split `--tensor-parallel` ways, for each
sequence length of `--lengths`, with `sequence_parallel=False` and
`True`, and reads each compiled step's memory from XLA's
`memory_analysis()`: its temporaries (the activations and their
gradients) and its peak, per device. The collectives of the compiled HLO
are counted too. Prints a table and writes a plot of temporaries against
sequence length (`--plot`).

    KERAS_BACKEND=jax python benchmarks/sequence_parallel.py
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras_tp  # noqa: E402


def step_of(length, hidden, heads, layers, batch, tensor_parallel, sequence):
    """`(split model, its compiled training step)` of the GPT2 backbone,
    after one training step."""
    import keras_hub
    import numpy as np

    from benchmarks.jax_steps import compiled_train_step

    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=1024,
        num_layers=layers,
        num_heads=heads,
        hidden_dim=hidden,
        intermediate_dim=4 * hidden,
        max_sequence_length=length,
    )
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(0, 1024, (batch, length), dtype="int32"),
        "padding_mask": np.ones((batch, length), "int32"),
    }
    y = rng.normal(size=(batch, length, hidden)).astype("float32")
    tp = keras_tp.TensorParallelKeras(
        backbone, world_size=tensor_parallel, sequence_parallel=sequence
    )
    tp.compile(optimizer="sgd", loss="mse")
    tp.train_on_batch(x, y)
    return tp, compiled_train_step(tp, x, y)


def measure(lengths, hidden, heads, layers, batch, tensor_parallel):
    """`[{length, sequence_parallel, temporaries, peak, hlo}]`."""
    from benchmarks.jax_steps import hlo_collectives
    from benchmarks.jax_steps import step_memory

    rows = []
    for length in lengths:
        for sequence in (False, True):
            _, compiled = step_of(
                length, hidden, heads, layers, batch, tensor_parallel, sequence
            )
            memory = step_memory(compiled)
            rows.append(
                {
                    "length": length,
                    "sequence_parallel": sequence,
                    "temporaries": memory["temporaries"],
                    "peak": memory["peak"],
                    "hlo": {
                        kind: counts["ops"]
                        for kind, counts in hlo_collectives(compiled).items()
                        if counts["ops"]
                    },
                }
            )
    return rows


def plot(rows, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(5.5, 3.4))
    for sequence, label in ((False, "TP"), (True, "TP + sequence parallel")):
        mine = [r for r in rows if r["sequence_parallel"] == sequence]
        ax.plot(
            [r["length"] for r in mine],
            [r["temporaries"] / 2**20 for r in mine],
            "o-",
            label=label,
        )
    ax.set_xscale("log", base=2)
    lengths = sorted({r["length"] for r in rows})
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("sequence length")
    ax.set_ylabel("activations per device (MiB)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[128, 256, 512]
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--tensor-parallel", type=int, default=4)
    parser.add_argument("--plot", help="path of a PNG plot to write")
    parser.add_argument("--json", help="path of a JSON file to write")
    args = parser.parse_args()
    keras_tp.configure_virtual_devices(args.tensor_parallel)
    rows = measure(
        args.lengths,
        args.hidden,
        args.heads,
        args.layers,
        args.batch,
        args.tensor_parallel,
    )
    print(
        f"GPT2 backbone, hidden {args.hidden}, {args.heads} heads, "
        f"{args.layers} blocks, batch {args.batch}, TP={args.tensor_parallel}"
    )
    print("length  temporaries MiB (TP / +SP / ratio)  peak MiB (TP / +SP)")
    for plain, split in zip(rows[::2], rows[1::2]):
        print(
            f"{plain['length']:6d}  {plain['temporaries'] / 2**20:9.1f} / "
            f"{split['temporaries'] / 2**20:7.1f} / "
            f"{plain['temporaries'] / split['temporaries']:5.2f}x"
            f"   {plain['peak'] / 2**20:7.1f} / {split['peak'] / 2**20:7.1f}"
            f"   HLO: {plain['hlo']} -> {split['hlo']}"
        )
    if args.plot:
        plot(
            rows,
            args.plot,
            f"GPT2 hidden {args.hidden}, TP={args.tensor_parallel}: "
            "XLA temporaries of the training step",
        )
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"arguments": vars(args), "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
