"""Item 1: keras_tp against Keras' own `ModelParallel` on JAX, same split.

One GPT-style LM is split the same way twice on the same mesh: by
keras_tp (`TensorParallelKeras`, explicit `shard_map` regions with
Megatron's collectives) and by `keras.distribution.ModelParallel` given
`plan.to_layout_map()` (XLA's GSPMD partitioner places the collectives).
Both train on the same data with Adam. Measured, interleaved:

- the step time of `fit()` once compiled;
- the first two `fit()` epochs of a fresh model, where every compilation
  of the step happens (the step count is reported: a step whose inputs
  change layout between calls compiles again);

and, from the compiled steps, the collectives XLA runs, the peak memory
of one device, and the bytes each device stores. The losses of the first
epoch must agree (same split, same arithmetic).
"""

import contextlib
import time

import keras

import keras_tp
from benchmarks import jax_steps
from benchmarks.models import compile_for_training
from benchmarks.models import language_data
from benchmarks.models import language_model
from benchmarks.timing import comparison
from benchmarks.timing import interleaved
from benchmarks.timing import ratio


def run(
    progress,
    tensor_parallel,
    dim,
    blocks,
    heads,
    seq_len,
    vocab,
    batch,
    steps,
    repeats,
    compile_repeats,
):
    """Measures item 1 at one tensor-parallel size.

    Args:
        progress: callable taking the fraction of the work done.
        tensor_parallel: devices of the `model` axis.
        dim, blocks, heads, seq_len, vocab: the LM's shape.
        batch: global batch size.
        steps: training steps per timed `fit()` epoch.
        repeats: rounds of the step-time comparison.
        compile_repeats: fresh models built per side for the compile
            comparison.

    Returns:
        `{"rows": [...], "data": {...}}`.
    """
    shape = dict(dim=dim, blocks=blocks, heads=heads, seq_len=seq_len)
    x, y = language_data(batch * steps, seq_len, vocab)
    fit_args = dict(x=x, y=y, batch_size=batch, shuffle=False, verbose=0)
    devices = keras.distribution.list_devices()[:tensor_parallel]
    # The plan TensorParallelKeras makes on JAX without a data axis (whose
    # ranks never run code between regions on slices: no local check).
    plan = keras_tp.auto_plan(
        language_model(vocab=vocab, **shape),
        tensor_parallel=tensor_parallel,
        check_local=False,
    )
    counter = jax_steps.CompileCounter()
    built = {}
    setup_seconds = {"keras_tp": [], "ModelParallel": []}
    details = {"keras_tp": [], "ModelParallel": []}

    def build(name):
        start = time.perf_counter()
        if name == "keras_tp":
            model = keras_tp.TensorParallelKeras(
                language_model(vocab=vocab, **shape),
                world_size=tensor_parallel,
            )
            distribution = None
        else:
            mesh = keras.distribution.DeviceMesh(
                (1, tensor_parallel), ["batch", "model"], devices=devices
            )
            distribution = keras.distribution.ModelParallel(
                layout_map=plan.to_layout_map(mesh), batch_dim_name="batch"
            )
            with distribution.scope():
                model = language_model(vocab=vocab, **shape)
        setup_seconds[name].append(time.perf_counter() - start)
        return model, distribution

    def first_two_epochs(name):
        """A fresh model's first two `fit()` epochs: every compile is here."""
        model, distribution = build(name)
        compiles_before = counter.train_step_compiles()
        start = time.perf_counter()
        with _scope(distribution):
            compile_for_training(model)
            first = model.fit(**fit_args).history["loss"][0]
            model.fit(**fit_args)
        elapsed = time.perf_counter() - start
        with _scope(distribution):
            model.fit(**fit_args)
        details[name].append(
            {
                "first_epoch_loss": first,
                "train_step_compiles_in_3_fits": counter.train_step_compiles()
                - compiles_before,
            }
        )
        built[name] = (model, distribution)
        return elapsed

    work = compile_repeats + 1 + repeats
    compile_times = interleaved(
        {
            "keras_tp": lambda: first_two_epochs("keras_tp"),
            "ModelParallel": lambda: first_two_epochs("ModelParallel"),
        },
        compile_repeats,
        progress=lambda f: progress(f * compile_repeats / work),
    )

    def one_epoch(name):
        model, distribution = built[name]
        with _scope(distribution):
            start = time.perf_counter()
            model.fit(**fit_args)
            return (time.perf_counter() - start) / steps

    step_times = interleaved(
        {name: (lambda n=name: one_epoch(n)) for name in built},
        repeats,
        warmup=1,
        progress=lambda f: progress(
            (compile_repeats + f * (1 + repeats)) / work
        ),
    )

    batch_x, batch_y = x[:batch], y[:batch]
    compiled = {
        name: jax_steps.compiled_train_step(model, batch_x, batch_y, dist)
        for name, (model, dist) in built.items()
    }
    memory = {name: jax_steps.step_memory(c) for name, c in compiled.items()}
    stored = {
        name: max(jax_steps.bytes_per_device(model.variables).values())
        for name, (model, _) in built.items()
    }
    loss_difference = max(
        abs(a["first_epoch_loss"] - b["first_epoch_loss"])
        for a, b in zip(details["keras_tp"], details["ModelParallel"])
    )
    compiles = {
        name: max(d["train_step_compiles_in_3_fits"] for d in entries)
        for name, entries in details.items()
    }
    label = f"TP={tensor_parallel}"
    rows = [
        comparison(
            f"keras_tp {label}: training step (compiled)",
            f"ModelParallel {label}, same LayoutMap",
            ratio(step_times, "keras_tp", "ModelParallel"),
            goal=("<=", 0.95),
        ),
        comparison(
            f"keras_tp {label}: first two fit() epochs of a fresh model",
            f"ModelParallel {label}",
            ratio(compile_times, "keras_tp", "ModelParallel"),
            goal=("<=", 1.0),
            note=(
                f"train-step compilations in the first 3 fit() calls: "
                f"keras_tp {compiles['keras_tp']}, "
                f"ModelParallel {compiles['ModelParallel']}"
            ),
        ),
        comparison(
            f"keras_tp {label}: peak memory of the compiled step, per device",
            f"ModelParallel {label}",
            memory["keras_tp"]["peak"] / memory["ModelParallel"]["peak"],
            note="XLA memory_analysis() of the jitted train_step",
        ),
    ]
    return {
        "rows": rows,
        "data": {
            "tensor_parallel": tensor_parallel,
            "model": dict(shape, vocab=vocab, batch=batch),
            "step_seconds": step_times,
            "first_two_epochs_seconds": compile_times,
            "setup_seconds": setup_seconds,
            "train_step_compiles_in_3_fits": compiles,
            "first_epoch_loss_difference": loss_difference,
            "hlo_collectives": {
                name: jax_steps.hlo_collectives(c)
                for name, c in compiled.items()
            },
            "hlo_ops": {
                name: jax_steps.hlo_op_counts(c) for name, c in compiled.items()
            },
            "step_memory": memory,
            "stored_bytes_largest_device": stored,
        },
    }


def _scope(distribution):
    return distribution.scope() if distribution else contextlib.nullcontext()
