"""The GPU run's measurements, each called in a worker process.

`benchmarks/worker.py` calls these in a fresh process of the task's
backend, so each function may set its backend's devices up first. Each
returns `{"rows": [...], "data": {...}}` as the suite's tasks do.
"""

import importlib
import time

import keras

import keras_tp
from benchmarks import models
from benchmarks.timing import comparison
from benchmarks.timing import interleaved
from benchmarks.timing import ratio

# Dense bf16 peak, FLOP/s, by a word of the device's name (the vendors'
# data sheets, SXM parts). A GPU not listed reports TFLOP/s only.
BF16_PEAK_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}


def gpu_name():
    """The name of the first GPU this process's backend sees, or `None`."""
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        gpus = [d for d in jax.devices() if d.platform == "gpu"]
        return gpus[0].device_kind if gpus else None
    if backend == "torch":
        import torch

        available = torch.cuda.is_available()
        return torch.cuda.get_device_name(0) if available else None
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    details = tf.config.experimental.get_device_details(gpus[0])
    return details.get("device_name", gpus[0].name)


def backend_run(progress, sizes, require_gpu):
    """Everything this backend measures (`tasks.parts`), in this process.

    Args:
        progress: callable taking the fraction of the work done.
        sizes: one of `tasks.SIZES`.
        require_gpu: measure nothing if the backend sees no GPU.

    Returns:
        `{"rows", "data"}`: each row names its `part`; `data.gpu` is the
        GPU seen, `None` for none, and `data[part]` each part's data.
    """
    from benchmarks.gpu import tasks

    data = {"gpu": gpu_name()}
    rows = []
    if require_gpu and data["gpu"] is None:
        return {"rows": rows, "data": data}
    measured = tasks.parts(keras.backend.backend(), sizes)
    for index, (label, function, kwargs) in enumerate(measured):
        module_name, function_name = function.split(":")
        module = importlib.import_module(module_name)

        def part_progress(fraction, index=index):
            progress((index + fraction) / len(measured))

        start = time.perf_counter()
        result = getattr(module, function_name)(
            progress=part_progress, **kwargs
        )
        rows += [dict(row, part=label) for row in result["rows"]]
        seconds = time.perf_counter() - start
        data[label] = dict(result["data"], seconds=seconds)
    return {"rows": rows, "data": data}


def epoch_seconds(model, x, y, batch):
    """Seconds per step of one `fit()` epoch over `(x, y)` (`x` may be a
    dict of inputs: the steps are counted from `y`)."""
    start = time.perf_counter()
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    return (time.perf_counter() - start) / (len(y) // batch)


def first_loss_and_times(trained, x, y, batch, repeats, progress, warmup=0):
    """Each of `trained`'s models' first-epoch loss, then its seconds per
    step, timed in interleaved rounds (`timing.interleaved`).

    Returns:
        `(first losses, times)`, both by the names of `trained`.
    """
    first = {
        name: model.fit(
            x, y, batch_size=batch, shuffle=False, verbose=0
        ).history["loss"][0]
        for name, model in trained.items()
    }
    times = interleaved(
        {
            name: (lambda m=model: epoch_seconds(m, x, y, batch))
            for name, model in trained.items()
        },
        repeats,
        warmup=warmup,
        progress=progress,
    )
    return first, times


def one_rank_lm(shape, policy):
    """The suite's LM in `TensorParallelKeras(world_size=1)`, compiled,
    its layers built under the dtype policy `policy`."""
    keras.config.set_dtype_policy(policy)
    try:
        model = keras_tp.TensorParallelKeras(
            models.language_model(**shape), world_size=1
        )
    finally:
        keras.config.set_dtype_policy("float32")
    return models.compile_for_training(model)


def mixed_precision(progress, lm, batch, steps, repeats):
    """`mixed_bfloat16` and `mixed_float16` (its loss scaled) against
    float32 training: step time and loss.

    The models start from the same weights and see the same batches; the
    loss of their first epoch tells whether each trains alike. JAX's CPU
    has no float16 matrix product with float32 accumulation, so there
    (the CPU smoke) `mixed_float16` is left out.
    """
    x, y = models.language_data(batch * steps, lm["seq_len"], lm["vocab"])
    backend = keras.backend.backend()
    policies = ["float32", "mixed_bfloat16", "mixed_float16"]
    if backend == "jax" and gpu_name() is None:
        policies.remove("mixed_float16")
    trained = {p: one_rank_lm(lm, p) for p in policies}
    first, times = first_loss_and_times(
        trained, x, y, batch, repeats, progress, warmup=1
    )
    rows = []
    for policy in policies[1:]:
        rows += [
            comparison(
                f"{backend}: {policy} training step",
                "float32 training step",
                ratio(times, policy, "float32"),
                goal=("<=", 1.0),
                note="keras_tp world_size=1; same weights and batches",
            ),
            comparison(
                f"{backend}: {policy} first-epoch loss",
                "float32 first-epoch loss",
                first[policy] / first["float32"],
                goal=("within", 0.02),
            ),
        ]
    return {
        "rows": rows,
        "data": {"first_epoch_loss": first, "step_seconds": times},
    }


def gpt2(config, seq_len):
    """keras-hub's GPT2 causal LM from `config`: random weights, bf16."""
    import keras_hub

    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        backbone = keras_hub.models.GPT2Backbone(
            max_sequence_length=seq_len, dropout=0.0, **config
        )
        return keras_hub.models.GPT2CausalLM(
            backbone=backbone, preprocessor=None
        )
    finally:
        keras.config.set_dtype_policy("float32")


def step_flops(params, config, seq_len, tokens):
    """Training FLOPs of a step: `6 N` per token for the weights' matmuls
    (forward and backward), and `12 L d s` per token for attention's
    scores and weighted sums (PaLM's appendix B)."""
    attention = 12 * config["num_layers"] * config["hidden_dim"] * seq_len
    return (6 * params + attention) * tokens


def gpt2_mfu(progress, config, seq_len, batch, steps):
    """Model FLOPs utilisation of a GPT2 step in keras_tp (world_size=1).

    The FLOPs are counted from the shapes (`step_flops`), not profiled;
    the peak is the GPU's dense bf16 one (`BF16_PEAK_FLOPS`).
    """
    import numpy as np

    rng = np.random.default_rng(0)
    tokens = rng.integers(
        0, config["vocabulary_size"], (batch * steps, seq_len)
    )
    x = {
        "token_ids": tokens.astype("int32"),
        "padding_mask": np.ones_like(tokens, dtype="int32"),
    }
    y = np.roll(tokens, -1, axis=1).astype("int32")
    tp = keras_tp.TensorParallelKeras(gpt2(config, seq_len), world_size=1)
    tp.compile(
        optimizer=keras.optimizers.AdamW(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    compile_seconds = epoch_seconds(tp, x, y, batch) * steps
    progress(0.5)
    seconds = min(epoch_seconds(tp, x, y, batch) for _ in range(2))
    progress(1.0)
    params = int(tp.count_params())
    flops = step_flops(params, config, seq_len, batch * seq_len)
    name = gpu_name()
    peak = next(
        (p for k, p in BF16_PEAK_FLOPS.items() if k in (name or "")), None
    )
    backend = keras.backend.backend()
    what = f"{backend}: GPT2 step, {params / 1e6:.0f}M parameters, bf16"
    rows = [comparison(what, "TFLOP/s", flops / seconds / 1e12, unit="TFLOP/s")]
    if peak is not None:
        rows.append(
            comparison(
                what,
                f"{name} dense bf16 peak",
                100 * flops / seconds / peak,
                unit="%",
            )
        )
    return {
        "rows": rows,
        "data": {
            "gpu": name,
            "parameters": params,
            "flops_per_step": flops,
            "step_seconds": seconds,
            "first_epoch_seconds": compile_seconds,
        },
    }


def two_logical_devices(memory_limit_mb):
    """TensorFlow's two logical devices: halves of the GPU, else of the CPU.

    Must run before TensorFlow starts its devices.
    """
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        keras_tp.configure_virtual_devices(2)
        return ["cpu:0", "cpu:1"]
    half = tf.config.LogicalDeviceConfiguration(memory_limit=memory_limit_mb)
    tf.config.set_logical_device_configuration(gpus[0], [half, half])
    return ["gpu:0", "gpu:1"]


def tensorflow_logical_tp(progress, lm, batch, steps, repeats, memory_limit_mb):
    """TensorFlow TP=2 over two logical devices of one card, against one.

    Two halves of one GPU share its compute, so the ratio is keras_tp's
    cost (collectives, split kernels), not a speed-up; the losses of the
    first epoch must agree, as the split computes the same model.
    """
    devices = two_logical_devices(memory_limit_mb)
    x, y = models.language_data(batch * steps, lm["seq_len"], lm["vocab"])
    trained = {
        "one device": models.compile_for_training(models.language_model(**lm)),
        "TP=2": models.compile_for_training(
            keras_tp.TensorParallelKeras(
                models.language_model(**lm), world_size=2, device_ids=devices
            )
        ),
    }
    first, times = first_loss_and_times(trained, x, y, batch, repeats, progress)
    return {
        "rows": [
            comparison(
                f"tensorflow keras_tp TP=2 on {devices}: training step",
                "one device",
                ratio(times, "TP=2", "one device"),
                note="two logical devices of one card share its compute",
            ),
            comparison(
                "tensorflow keras_tp TP=2: first-epoch loss",
                "one device",
                abs(first["TP=2"] - first["one device"]),
                goal=("<=", 1e-4),
                unit="",
            ),
        ],
        "data": {
            "devices": devices,
            "first_epoch_loss": first,
            "step_seconds": times,
        },
    }
