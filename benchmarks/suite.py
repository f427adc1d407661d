"""The items of issue #14 and the processes that measure them.

Each item is a list of tasks; a task is one process of one backend (see
`benchmarks/worker.py`). The full sizes are close to the issue's but sized
for a 2-core CPU machine, where the whole suite takes about a quarter of
an hour; `quick` sizes only check that everything runs.
"""

import collections

Item = collections.namedtuple("Item", ["title", "tasks"])

# The GPT-style LM of items 1-3 and 5-6: width and heads as in the issue;
# two blocks and 64 tokens (instead of 4 and 128) keep a CPU step near a
# second. The quick LM is tiny.
LM = dict(dim=512, blocks=2, heads=8, seq_len=64, vocab=1024)
QUICK_LM = dict(dim=32, blocks=1, heads=4, seq_len=8, vocab=64)
MLP = dict(features=512, blocks=4, classes=16)
QUICK_MLP = dict(features=32, blocks=1, classes=4)


def _task(item, label, backend, function, devices=None, **kwargs):
    return {
        "item": item,
        "label": label,
        "backend": backend,
        "devices": devices,
        "function": function,
        "kwargs": kwargs,
    }


def _model_parallel(quick):
    lm = QUICK_LM if quick else LM
    timing = (
        dict(batch=4, steps=1, repeats=1, compile_repeats=1)
        if quick
        else dict(batch=8, steps=3, repeats=7, compile_repeats=2)
    )
    return [
        _task(
            1,
            f"JAX TP={n} vs ModelParallel",
            "jax",
            "benchmarks.model_parallel:run",
            devices=n,
            tensor_parallel=n,
            **lm,
            **timing,
        )
        for n in ((2,) if quick else (2, 4))
    ]


def _fit_timing(quick):
    """Batch, steps per round and rounds of a benchmark timing `fit()`.

    Eight steps per round: with two, fit()'s fixed cost and one slow step
    decided a round (a 1.4x "overhead" on TensorFlow that was noise).
    """
    if quick:
        return dict(batch=4, steps=1, repeats=1)
    return dict(batch=8, steps=8, repeats=7)


def _world_one(quick):
    lm = QUICK_LM if quick else LM
    timing = _fit_timing(quick)
    return [
        _task(
            2,
            f"{backend} world_size=1 vs plain fit",
            backend,
            "benchmarks.world_one:run",
            **lm,
            **timing,
        )
        for backend in ("jax", "torch", "tensorflow")
    ]


def _torch_tp(quick):
    timing = dict(steps=1, repeats=1) if quick else dict(steps=4, repeats=7)
    # (workload, shape, batch): 64 rows give the MLP some compute per step.
    workloads = (
        (("mlp", QUICK_MLP, 4), ("lm", QUICK_LM, 4))
        if quick
        else (("mlp", MLP, 64), ("lm", LM, 8))
    )
    return [
        _task(
            3,
            f"torch TP=2 ({workload}) vs parallelize_module",
            "torch",
            "benchmarks.torch_tp:run",
            workload=workload,
            sizes=sizes,
            batch=batch,
            **timing,
        )
        for workload, sizes, batch in workloads
    ]


def _tensorflow(quick):
    lm = QUICK_LM if quick else LM
    timing = _fit_timing(quick)
    return [
        _task(
            4,
            "TensorFlow TP=2 and DDP=2 vs MirroredStrategy",
            "tensorflow",
            "benchmarks.tensorflow_replicas:run",
            devices=2,
            **lm,
            **timing,
        )
    ]


def _memory(quick):
    return [
        _task(
            5,
            "JAX bytes per device: TP 1-8, ZeRO 0-3",
            "jax",
            "benchmarks.memory:run",
            devices=4 if quick else 8,
            sizes=QUICK_LM if quick else LM,
            batch=8,
            world_sizes=(1, 2, 4) if quick else (1, 2, 4, 8),
            data_parallel=(2,) if quick else (2, 8),
            zero_stages=(0, 1, 2, 3),
        )
    ]


def _communication(quick):
    # Counts do not depend on size: a small LM keeps this item cheap.
    sizes = QUICK_LM if quick else dict(LM, dim=128, heads=4, vocab=256)
    return [
        _task(
            6,
            f"{backend} collectives per step",
            backend,
            "benchmarks.communication:run",
            devices=2,
            sizes=sizes,
            batch=4,
            zero_stages=(0, 1, 2, 3),
        )
        for backend in ("jax", "torch")
    ]


def _scaling(quick):
    return [
        _task(
            7,
            "JAX TP=2 as hidden grows",
            "jax",
            "benchmarks.scaling:run",
            devices=2,
            hidden_sizes=(32, 64) if quick else (256, 512, 1024, 2048),
            blocks=1,
            heads=4 if quick else 8,
            seq_len=8 if quick else 32,
            vocab=64 if quick else 1024,
            batch=4,
            steps=1 if quick else 2,
            repeats=1 if quick else 3,
        )
    ]


def _buckets(quick):
    return [
        _task(
            8,
            "torch DDP=2 bucket_cap_mb sweep",
            "torch",
            "benchmarks.buckets:run",
            sizes=QUICK_MLP if quick else MLP,
            batch=8 if quick else 32,
            steps=1 if quick else 4,
            repeats=1 if quick else 7,
            bucket_caps_mb=(0.001, 25) if quick else (1, 5, 10, 25, 50),
        )
    ]


def _straggler(quick):
    return [
        _task(
            9,
            "torch: a 3x straggler, DDP vs async SGD vs local SGD",
            "torch",
            "benchmarks.straggler:run",
            rounds=1 if quick else 3,
            quick=quick,
        )
    ]


ITEMS = {
    1: Item(
        "JAX training step and compile, against Keras ModelParallel",
        _model_parallel,
    ),
    2: Item(
        "TensorParallelKeras(world_size=1) against plain fit, each backend",
        _world_one,
    ),
    3: Item(
        "torch TP=2 against PyTorch's parallelize_module",
        _torch_tp,
    ),
    4: Item(
        "TensorFlow TP=2 and DDP=2 against one device and MirroredStrategy",
        _tensorflow,
    ),
    5: Item(
        "Memory per device against the ideal and DeepSpeed's ZeRO formulas",
        _memory,
    ),
    6: Item(
        "Collectives per step against Megatron, DDP and ZeRO",
        _communication,
    ),
    7: Item("Cost as the hidden width grows, JAX TP=2", _scaling),
    8: Item("DDP bucket size sweep, torch", _buckets),
    9: Item(
        "A 3x slower worker: synchronous DDP, async SGD and local SGD, torch",
        _straggler,
    ),
}


def tasks(only=None, quick=False):
    """The tasks of the chosen items, in item order.

    Args:
        only: item numbers to run; `None` runs every item.
        quick: seconds-long sizes, to check that the suite runs.

    Returns:
        A list of task dicts.
    """
    chosen = sorted(ITEMS) if only is None else sorted(set(only))
    unknown = [number for number in chosen if number not in ITEMS]
    if unknown:
        raise ValueError(
            f"Unknown item(s) {unknown}; the items are {sorted(ITEMS)}."
        )
    return [task for n in chosen for task in ITEMS[n].tasks(quick)]
