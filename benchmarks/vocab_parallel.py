"""A keras-hub LM's training step with the logits split by vocabulary.

Builds keras-hub's `GPT2CausalLM` (random weights, hidden 128, 2 blocks,
sequence 128, batch 8, a 32k vocabulary by default) split
`--tensor-parallel` ways, twice: with the accuracy metric, whose loss and
metric read the LM head's split logits (`keras_tp.vocab_parallel`), and
with a top-5 accuracy metric, which needs the logits whole, so the head
gathers them (what every step did before). It measures each training
step's memory per device, on the `--backend`'s terms:

- `jax` (the default), on virtual CPU devices: XLA's memory analysis of
  each compiled step, next to `keras.distribution.ModelParallel` given the
  same plan as a `LayoutMap` (XLA's GSPMD partitioner places the
  collectives), and whether a whole logits tensor (batch x sequence x
  vocabulary) appears anywhere in each compiled program's HLO;
- `torch`, one gloo process per rank (`keras_tp.launch`): the tensors
  rank 0 creates during one training step, followed by a dispatch mode:
  the peak of their bytes alive at once, and the largest one; next to the
  model on one process;
- `tensorflow`, on virtual CPU devices: how far the bytes TensorFlow's
  CPU allocator holds rise during one training step, every replica's
  together (virtual devices share one allocator); next to the model on
  one device.

    python benchmarks/vocab_parallel.py --tensor-parallel 4 --vocab 32000
    python benchmarks/vocab_parallel.py --backend torch
"""

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--backend", choices=("jax", "torch", "tensorflow"), default="jax"
    )
    parser.add_argument("--tensor-parallel", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = args.backend
    # TensorFlow's CPU allocator keeps statistics only as a BFC allocator.
    os.environ["TF_CPU_ALLOCATOR_USE_BFC"] = "true"
    os.environ.setdefault(
        "XLA_FLAGS",
        f"--xla_force_host_platform_device_count={args.tensor_parallel}",
    )
    sys.path.insert(0, ROOT)
    sizes = (args.tensor_parallel, args.vocab, args.length, args.batch)
    whole = f"[{args.batch},{args.length},{args.vocab}]"
    whole_bytes = args.batch * args.length * args.vocab * 4
    print(f"GPT2CausalLM, vocabulary {args.vocab}, TP={args.tensor_parallel}")
    print(f"whole logits: f32{whole}, {whole_bytes / 2**20:.1f} MiB")
    if args.backend == "jax":
        print(f"| step | temporaries MiB | peak MiB | f32{whole} in HLO |")
        print("|---|---|---|---|")
        for name, (memory, hlo) in measure(*sizes).items():
            print(
                f"| {name} | {memory['temporaries'] / 2**20:.1f} | "
                f"{memory['peak'] / 2**20:.1f} | {'f32' + whole in hlo} |"
            )
        return
    if args.backend == "torch":
        print("| step on rank 0 | peak MiB | largest tensor MiB |")
        print("|---|---|---|")
        for name, (peak, largest) in measure_torch(*sizes).items():
            print(f"| {name} | {peak / 2**20:.1f} | {largest / 2**20:.1f} |")
        return
    print("| step | step's peak MiB, every replica's together |")
    print("|---|---|")
    for name, peak in measure_tensorflow(*sizes).items():
        print(f"| {name} | {peak / 2**20:.1f} |")


def _causal_lm(vocab, length):
    import keras
    import keras_hub

    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.GPT2Backbone(
        vocabulary_size=vocab,
        num_layers=2,
        num_heads=4,
        hidden_dim=128,
        intermediate_dim=512,
        max_sequence_length=length,
        dropout=0.0,
    )
    return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)


def measure(tensor_parallel, vocab, length, batch):
    """`{step name: (XLA's step memory, compiled HLO text)}`."""
    import keras

    import keras_tp
    from benchmarks.jax_steps import compiled_train_step
    from benchmarks.jax_steps import step_memory

    x, y = _batch(vocab, length, batch)
    rows = {}
    for name, tp in _wrapped(tensor_parallel, vocab, length):
        tp.train_on_batch(x, y)
        compiled = compiled_train_step(tp, x, y)
        rows[name] = (step_memory(compiled), compiled.as_text())
    plan = keras_tp.auto_plan(
        _causal_lm(vocab, length),
        tensor_parallel=tensor_parallel,
        check_local=False,
    )
    devices = keras.distribution.list_devices()[:tensor_parallel]
    mesh = keras.distribution.DeviceMesh(
        (1, tensor_parallel), ["batch", "model"], devices=devices
    )
    distribution = keras.distribution.ModelParallel(
        layout_map=plan.to_layout_map(mesh), batch_dim_name="batch"
    )
    with distribution.scope():
        model = _causal_lm(vocab, length)
        _compiled(model, keras.metrics.SparseCategoricalAccuracy)
        model.train_on_batch(x, y)
    compiled = compiled_train_step(model, x, y, distribution)
    rows["ModelParallel, same LayoutMap"] = (
        step_memory(compiled),
        compiled.as_text(),
    )
    return {
        name: (memory, _shapes(hlo)) for name, (memory, hlo) in rows.items()
    }


def _batch(vocab, length, batch):
    """`(x, y)`: random token ids and their next tokens."""
    import numpy as np

    ids = np.random.default_rng(0).integers(
        0, vocab, (batch, length + 1), dtype="int32"
    )
    x = {
        "token_ids": ids[:, :-1],
        "padding_mask": np.ones((batch, length), "int32"),
    }
    return x, ids[:, 1:]


def _compiled(model, metric):
    import keras

    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=[metric()],
    )
    return model


def _wrapped(tensor_parallel, vocab, length):
    """`(name, compiled TensorParallelKeras)`: the logits kept split (the
    accuracy metric), then whole (top-5 accuracy needs them)."""
    import keras

    import keras_tp

    for name, metric in (
        ("keras_tp, split logits", keras.metrics.SparseCategoricalAccuracy),
        ("keras_tp, whole logits", keras.metrics.SparseTopKCategoricalAccuracy),
    ):
        tp = keras_tp.TensorParallelKeras(
            _causal_lm(vocab, length), world_size=tensor_parallel
        )
        yield name, _compiled(tp, metric)


def measure_torch(tensor_parallel, vocab, length, batch):
    """`{step name: (peak bytes, largest tensor bytes)}` of the tensors
    rank 0 creates during one training step (after one to warm up)."""
    import keras_tp

    return keras_tp.launch(
        _torch_rank,
        world_size=tensor_parallel,
        args=(tensor_parallel, vocab, length, batch),
        timeout=1800,
    )


def _torch_rank(tensor_parallel, vocab, length, batch):
    import keras
    import torch.distributed as dist

    x, y = _batch(vocab, length, batch)
    rows = {}
    for name, tp in _wrapped(tensor_parallel, vocab, length):
        tp.train_on_batch(x, y)
        rows[name] = torch_step_memory(lambda: tp.train_on_batch(x, y))
    # One process: rank 0 alone; the others wait.
    if dist.get_rank() == 0:
        model = _compiled(
            _causal_lm(vocab, length), keras.metrics.SparseCategoricalAccuracy
        )
        model.train_on_batch(x, y)
        rows["one process"] = torch_step_memory(
            lambda: model.train_on_batch(x, y)
        )
    dist.barrier()
    return rows


def torch_step_memory(step):
    """`(peak, largest)`: the most bytes of the tensors `step()` creates
    alive at once, and the largest of them (`live_tensors`)."""
    import gc

    with live_tensors() as live:
        step()
        gc.collect()
    return live.peak, live.largest


def live_tensors():
    """A `TorchDispatchMode` that follows the storages the operators it
    sees create: `alive`, `peak` and `largest` bytes. A storage stays
    alive as long as any tensor or autograd graph holds it (PyTorch keeps
    its Python object while it lives), so a finalizer sees it go.
    PyTorch's memory snapshots serve CUDA only, and its profiler's memory
    timeline fails on Keras' autograd graphs."""
    import weakref

    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class _LiveTensors(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.alive = self.peak = self.largest = 0
            self._held = set()

        def _released(self, key, nbytes):
            self.alive -= nbytes
            self._held.discard(key)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            outputs = func(*args, **(kwargs or {}))
            # A view of an input shares its storage: nothing new.
            inputs = {
                t.untyped_storage()._cdata
                for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)
            }
            for tensor in tree_leaves(outputs):
                if not isinstance(tensor, torch.Tensor):
                    continue
                storage = tensor.untyped_storage()
                key = storage._cdata
                if key in inputs or key in self._held:
                    continue
                nbytes = storage.nbytes()
                self._held.add(key)
                self.alive += nbytes
                self.peak = max(self.peak, self.alive)
                self.largest = max(self.largest, nbytes)
                weakref.finalize(storage, self._released, key, nbytes)
            return outputs

    return _LiveTensors()


def measure_tensorflow(tensor_parallel, vocab, length, batch):
    """`{step name: bytes}`: how far the bytes TensorFlow's CPU allocator
    holds (every virtual device's) rise above what they were before one
    training step, after one that traces it."""
    import keras
    import tensorflow as tf

    import keras_tp

    keras_tp.configure_virtual_devices(tensor_parallel)
    x, y = _batch(vocab, length, batch)
    models = list(_wrapped(tensor_parallel, vocab, length))
    one_device = _compiled(
        _causal_lm(vocab, length), keras.metrics.SparseCategoricalAccuracy
    )
    models.append(("one device", one_device))
    rows = {}
    for name, model in models:
        model.train_on_batch(x, y)
        tf.config.experimental.reset_memory_stats("CPU:0")
        held = tf.config.experimental.get_memory_info("CPU:0")["current"]
        model.train_on_batch(x, y)
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
        rows[name] = peak - held
    return rows


def _shapes(hlo):
    """The tensor types an HLO text names, layouts dropped."""
    return " ".join(re.findall(r"f32\[[0-9,]*\]", hlo))


if __name__ == "__main__":
    main()
