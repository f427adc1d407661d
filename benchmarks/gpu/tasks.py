"""The GPU run's tasks and their sizes: one card's, and the CPU smoke's.

A task is one worker process (`benchmarks/worker.py`). The full sizes are
meant to fit the whole run in 8 minutes on one H100 (JAX and torch took
3.3 minutes on one):
GPT2-medium's shape for the FLOPs utilisation, an LM of width 1024
elsewhere.
"""

from benchmarks.suite import QUICK_LM

BACKENDS = ("jax", "torch", "tensorflow")
# keras-hub's GPT2-medium (`gpt2_medium_en`), built from its shape.
GPT2_MEDIUM = dict(
    vocabulary_size=50257,
    num_layers=24,
    num_heads=16,
    hidden_dim=1024,
    intermediate_dim=4096,
)
SIZES = {
    "gpu": dict(
        lm=dict(dim=1024, blocks=4, heads=16, seq_len=512, vocab=8192),
        timing=dict(batch=16, steps=8, repeats=5),
        gpt2=dict(config=GPT2_MEDIUM, seq_len=1024, batch=8, steps=4),
        memory_limit_mb=30000,
    ),
    "smoke": dict(
        lm=QUICK_LM,
        timing=dict(batch=4, steps=1, repeats=1),
        gpt2=dict(
            config=dict(
                vocabulary_size=256,
                num_layers=2,
                num_heads=2,
                hidden_dim=32,
                intermediate_dim=64,
            ),
            seq_len=16,
            batch=2,
            steps=2,
        ),
        memory_limit_mb=1024,
    ),
}


def task(label, backend, function, **kwargs):
    """One worker process's task, as `benchmarks.runner.run_task` takes."""
    return {
        "item": "gpu",
        "label": label,
        "backend": backend,
        "devices": None,
        "function": function,
        "kwargs": kwargs,
    }


def backend_task(backend, sizes, smoke):
    """One process of `backend` measuring all it measures (`parts`):
    one start-up per backend, not one per measurement."""
    return task(
        f"{backend}: one process",
        backend,
        "benchmarks.gpu.measures:backend_run",
        sizes=sizes,
        require_gpu=not smoke,
    )


def logical_devices_task(sizes):
    """TensorFlow over two logical devices, set up before TensorFlow
    starts: a process of its own."""
    return task(
        "tensorflow: TP=2 on two logical devices of one card",
        "tensorflow",
        "benchmarks.gpu.measures:tensorflow_logical_tp",
        lm=sizes["lm"],
        memory_limit_mb=sizes["memory_limit_mb"],
        **sizes["timing"],
    )


def parts(backend, sizes):
    """`[(label, "module:function", kwargs)]` a backend's process runs."""
    lm, timing = sizes["lm"], sizes["timing"]
    measured = [
        (
            "world_size=1 vs plain fit",
            "benchmarks.world_one:run",
            dict(**lm, **timing),
        ),
        (
            "mixed precision vs float32",
            "benchmarks.gpu.measures:mixed_precision",
            dict(lm=lm, **timing),
        ),
        (
            "GPT2 model FLOPs utilisation",
            "benchmarks.gpu.measures:gpt2_mfu",
            sizes["gpt2"],
        ),
    ]
    if backend == "jax":
        measured.append(
            (
                "keras_tp vs ModelParallel, TP=1",
                "benchmarks.model_parallel:run",
                dict(tensor_parallel=1, compile_repeats=1, **lm, **timing),
            )
        )
    return measured
