"""A keras-hub LM's training step with the logits split by vocabulary.

Builds keras-hub's `GPT2CausalLM` (random weights, hidden 128, 2 blocks,
sequence 128, batch 8, a 32k vocabulary by default), compiles its training
step split `--tensor-parallel` ways three times on JAX's virtual CPU
devices, and prints XLA's memory analysis of each compiled step:

- keras_tp, whose loss and accuracy read the LM head's split logits
  (`keras_tp.vocab_parallel`);
- keras_tp with a top-5 accuracy metric, which needs the logits whole, so
  the head gathers them (what every step did before);
- `keras.distribution.ModelParallel` given the same plan as a `LayoutMap`
  (XLA's GSPMD partitioner places the collectives).

It also says whether a whole logits tensor (batch x sequence x
vocabulary) appears anywhere in each compiled program's HLO.

    python benchmarks/vocab_parallel.py --tensor-parallel 4 --vocab 32000
"""

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tensor-parallel", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    args = parser.parse_args()
    os.environ["KERAS_BACKEND"] = "jax"
    os.environ.setdefault(
        "XLA_FLAGS",
        f"--xla_force_host_platform_device_count={args.tensor_parallel}",
    )
    sys.path.insert(0, ROOT)
    rows = measure(args.tensor_parallel, args.vocab, args.length, args.batch)
    whole = f"f32[{args.batch},{args.length},{args.vocab}]"
    print(f"GPT2CausalLM, vocabulary {args.vocab}, TP={args.tensor_parallel}")
    print(f"| step | temporaries MiB | peak MiB | {whole} in HLO |")
    print("|---|---|---|---|")
    for name, (memory, hlo) in rows.items():
        print(
            f"| {name} | {memory['temporaries'] / 2**20:.1f} | "
            f"{memory['peak'] / 2**20:.1f} | {whole in hlo} |"
        )


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
    import numpy as np

    import keras_tp
    from benchmarks.jax_steps import compiled_train_step
    from benchmarks.jax_steps import step_memory

    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (batch, length + 1), dtype="int32")
    x = {
        "token_ids": ids[:, :-1],
        "padding_mask": np.ones((batch, length), "int32"),
    }
    y = ids[:, 1:]
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    rows = {}
    for name, metric in (
        ("keras_tp, split logits", keras.metrics.SparseCategoricalAccuracy),
        ("keras_tp, whole logits", keras.metrics.SparseTopKCategoricalAccuracy),
    ):
        tp = keras_tp.TensorParallelKeras(
            _causal_lm(vocab, length), world_size=tensor_parallel
        )
        tp.compile(optimizer="sgd", loss=loss, weighted_metrics=[metric()])
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
        model.compile(
            optimizer="sgd",
            loss=loss,
            weighted_metrics=[keras.metrics.SparseCategoricalAccuracy()],
        )
        model.train_on_batch(x, y)
    compiled = compiled_train_step(model, x, y, distribution)
    rows["ModelParallel, same LayoutMap"] = (
        step_memory(compiled),
        compiled.as_text(),
    )
    return {
        name: (memory, _shapes(hlo)) for name, (memory, hlo) in rows.items()
    }


def _shapes(hlo):
    """The tensor types an HLO text names, layouts dropped."""
    return " ".join(re.findall(r"f32\[[0-9,]*\]", hlo))


if __name__ == "__main__":
    main()
