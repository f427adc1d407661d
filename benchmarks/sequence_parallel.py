"""Activation memory with and without sequence parallelism.

Trains a GPT-style keras-hub backbone (hidden 512, 4 heads, 2 blocks by
default) split `--tensor-parallel` ways, for each sequence length of
`--lengths`, with `sequence_parallel=False` and `True`, and measures the
activations each device holds:

- JAX: the compiled training step's memory from XLA's
  `memory_analysis()`, its temporaries (the activations and their
  gradients) and its peak; the collectives of the compiled HLO are
  counted too.
- torch: the tensor bytes the forward pass leaves alive for the backward
  pass (the activations), and the most the step holds at once, weights
  and optimizer state excepted, on each of `--tensor-parallel`
  processes: the largest of each.
- TensorFlow: the bytes the forward pass leaves for the backward pass
  (the activations) on the device that holds the most, read from the
  traced training step's graph; and the step's peak above what was in
  use before it, read from the host allocator that the virtual CPU
  devices share, so every replica's together.

Prints a table and writes a plot of the activations against sequence
length (`--plot`).

    KERAS_BACKEND=jax python benchmarks/sequence_parallel.py
    KERAS_BACKEND=torch python benchmarks/sequence_parallel.py
    KERAS_BACKEND=tensorflow python benchmarks/sequence_parallel.py
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras_tp  # noqa: E402


def trained(length, hidden, heads, layers, batch, tensor_parallel, sequence):
    """`(split model, x, y)`: the GPT2 backbone split `tensor_parallel`
    ways, after one training step on the batch `(x, y)`."""
    import keras_hub
    import numpy as np

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
    return tp, x, y


def step_of(length, hidden, heads, layers, batch, tensor_parallel, sequence):
    """`(split model, its compiled training step)` of the GPT2 backbone
    (JAX), after one training step."""
    from benchmarks.jax_steps import compiled_train_step

    tp, x, y = trained(
        length, hidden, heads, layers, batch, tensor_parallel, sequence
    )
    return tp, compiled_train_step(tp, x, y)


def step_temporary_bytes(model, x, y, steps=3):
    """What a training step of `model` (torch) allocates, in bytes:
    `(held, peak)`, the tensors the forward pass leaves alive for the
    backward pass (the activations Megatron's formula counts) and the
    most the step holds at once (with the activations' gradients, as
    XLA's temporaries are on JAX). The weights and the optimizer's state,
    which live across steps, are not counted. Each is the least of
    `steps` steps: now and then a tensor of a step's own (64 KiB of the
    test's model) is still alive when its backward pass starts, by the
    timing of the threads that release it."""
    import gc
    import weakref

    import torch
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    kept = {
        v.value.untyped_storage().data_ptr()
        for v in model.variables + model.optimizer.variables
    }

    class LiveBytes(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.live = {}
            self.total = 0
            self.peak = 0
            self.held = None

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if DTensor in types:
                # Count the local tensors DTensor computes with.
                return NotImplemented
            # Autograd's engine runs a graph task only in a backward pass.
            if self.held is None and torch._C._current_graph_task_id() >= 0:
                # Garbage awaiting the cyclic collector is not held for the
                # backward pass: collected first, the count does not depend
                # on when the collector last ran.
                gc.collect()
                self.held = self.total
            out = func(*args, **(kwargs or {}))
            for tensor in torch.utils._pytree.tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                    self._allocated(tensor.untyped_storage())
            return out

        def _allocated(self, storage):
            address = storage.data_ptr()
            if not address or address in kept or address in self.live:
                return
            self.live[address] = storage.nbytes()
            self.total += storage.nbytes()
            weakref.finalize(storage, self._freed, address)
            self.peak = max(self.peak, self.total)

        def _freed(self, address):
            self.total -= self.live.pop(address)

    measured = []
    for _ in range(steps):
        with LiveBytes() as live:
            model.train_on_batch(x, y)
        measured.append((live.held, live.peak))
    held, peak = zip(*measured)
    return min(held), min(peak)


def tensorflow_held_bytes(model, x, y):
    """The bytes the forward pass of `model`'s training step leaves for
    its backward pass (TensorFlow), on the device that holds the most.

    Read from the traced step's graph: the forward tensors the backward
    pass's ops consume, each buffer once (an identity or a reshape shares its
    input's), less the weights' reads and the inputs, grouped by the
    device of the op that makes them.
    """
    import collections

    import tensorflow as tf

    runtime = model._runtime
    step = tf.function(lambda x, y: runtime._train_step(model, (x, y)))
    with runtime.adapter.stats.recording("train"):
        graph = step.get_concrete_function(
            tf.nest.map_structure(tf.convert_to_tensor, x),
            tf.convert_to_tensor(y),
        ).graph
    operations = graph.get_operations()
    # The graph lists its ops as they were made: the forward pass's, then
    # (from the first op the gradient tape makes) the backward pass's,
    # the custom gradients' collectives included.
    first = next(
        i for i, op in enumerate(operations) if "gradient_tape/" in op.name
    )
    forward = set(operations[:first])
    held = collections.Counter()
    counted = set()
    for op in operations[first:]:
        for tensor in op.inputs:
            if tensor.op not in forward:
                continue
            tensor = _buffer_of(tensor)
            if tensor.op.type in _NOT_ACTIVATIONS or tensor.name in counted:
                continue
            counted.add(tensor.name)
            size = tensor.shape.num_elements() * tensor.dtype.size
            held[tensor.op.device] += size
    return max(held[device] for device in held if device)


# Ops whose output shares their input's buffer.
_ALIASES = {"Identity", "IdentityN", "Reshape", "EnsureShape", "Squeeze"}
_NOT_ACTIVATIONS = {"ReadVariableOp", "Const", "Placeholder"}


def _buffer_of(tensor):
    """The tensor whose buffer `tensor` shares (itself, if none)."""
    while tensor.op.type in _ALIASES:
        index = tensor.value_index if tensor.op.type == "IdentityN" else 0
        source = tensor.op.inputs[index]
        if not source.shape.is_fully_defined():
            break
        tensor = source
    return tensor


def tensorflow_rows(lengths, hidden, heads, layers, batch, tensor_parallel):
    """The held bytes (`tensorflow_held_bytes`) for each length, without
    and with sequence parallelism, and the traced step's peak."""
    import tensorflow as tf

    rows = []
    for length in lengths:
        for sequence in (False, True):
            tp, x, y = trained(
                length, hidden, heads, layers, batch, tensor_parallel, sequence
            )
            before = tf.config.experimental.get_memory_info("CPU:0")["current"]
            tf.config.experimental.reset_memory_stats("CPU:0")
            tp.train_on_batch(x, y)
            peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
            stats = tp.communication_stats("train", axis="model")
            rows.append(
                {
                    "length": length,
                    "sequence_parallel": sequence,
                    "temporaries": tensorflow_held_bytes(tp, x, y),
                    "peak": peak - before,
                    "collectives": {
                        kind: entry["calls"] for kind, entry in stats.items()
                    },
                }
            )
            del tp
    return rows


def torch_rows(lengths, hidden, heads, layers, batch, tensor_parallel):
    """Run on every rank: the largest activation bytes over the ranks for
    each length, without and with sequence parallelism."""
    import torch
    import torch.distributed as dist

    rows = []
    for length in lengths:
        for sequence in (False, True):
            tp, x, y = trained(
                length, hidden, heads, layers, batch, tensor_parallel, sequence
            )
            local = torch.tensor(step_temporary_bytes(tp, x, y))
            dist.all_reduce(local, op=dist.ReduceOp.MAX)
            held, peak = local.tolist()
            stats = tp.communication_stats("train", axis="model")
            rows.append(
                {
                    "length": length,
                    "sequence_parallel": sequence,
                    "temporaries": held,
                    "peak": peak,
                    "collectives": {
                        kind: entry["calls"] for kind, entry in stats.items()
                    },
                }
            )
    return rows


def measure(lengths, hidden, heads, layers, batch, tensor_parallel):
    """`[{length, sequence_parallel, temporaries, ...}]`: with `peak` and
    `hlo` (its collectives) on JAX, `collectives` (counted) on torch."""
    import keras

    if keras.backend.backend() == "torch":
        return keras_tp.launch(
            torch_rows,
            world_size=tensor_parallel,
            args=(lengths, hidden, heads, layers, batch, tensor_parallel),
            timeout=3600,
        )
    if keras.backend.backend() == "tensorflow":
        return tensorflow_rows(
            lengths, hidden, heads, layers, batch, tensor_parallel
        )
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
    import keras

    backend = keras.backend.backend()
    if backend in ("jax", "tensorflow"):
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
    what = {
        "jax": "XLA temporaries of the training step",
        "torch": "activations held for the backward pass",
        "tensorflow": "activations held for the backward pass",
    }[backend]
    print(f"length  {what}, MiB per device (TP / +SP / ratio)")
    for plain, split in zip(rows[::2], rows[1::2]):
        peak = "host peak, all replicas" if backend == "tensorflow" else "peak"
        extra = f"   {peak} {plain['peak'] / 2**20:7.1f} / " + (
            f"{split['peak'] / 2**20:7.1f}   HLO: {plain['hlo']} -> "
            f"{split['hlo']}"
            if backend == "jax"
            else f"{split['peak'] / 2**20:7.1f}   counted: "
            f"{plain['collectives']} -> {split['collectives']}"
        )
        print(
            f"{plain['length']:6d}  {plain['temporaries'] / 2**20:9.1f} / "
            f"{split['temporaries'] / 2**20:7.1f} / "
            f"{plain['temporaries'] / split['temporaries']:5.2f}x" + extra
        )
    if args.plot:
        plot(
            rows,
            args.plot,
            f"GPT2 hidden {args.hidden}, TP={args.tensor_parallel} "
            f"({backend}): {what}",
        )
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"arguments": vars(args), "rows": rows}, file, indent=1)


if __name__ == "__main__":
    main()
