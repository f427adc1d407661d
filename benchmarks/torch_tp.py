"""Item 3: keras_tp on torch against PyTorch's own tensor parallelism.

Two gloo processes on the CPU (`keras_tp.launch`), each rank with its
share of the cores (one thread on two cores). In the same processes, round
by round:

- keras_tp TP=2: the Keras model wrapped by `TensorParallelKeras`, trained
  by `fit()`;
- PyTorch TP=2: the same architecture in `torch.nn`, split by
  `parallelize_module` with `ColwiseParallel`/`RowwiseParallel` over a
  `DeviceMesh("cpu", (2,))`, trained by a plain PyTorch loop with Adam;
- one process: the Keras model on rank 0 alone, with all the cores (rank 1
  waits in a barrier, which sleeps), and the `torch.nn` model likewise,
  which shows how much of a difference is Keras' own rather than keras_tp's.

The collectives of one step are counted on both sides: keras_tp's
`communication_stats()` and PyTorch's `CommDebugMode`.
"""

import time

import keras_tp
from benchmarks import models
from benchmarks import torch_models
from benchmarks.timing import comparison
from benchmarks.timing import interleaved
from benchmarks.timing import ratio
from keras_tp.launcher import usable_cores


def run(progress, workload, sizes, batch, steps, repeats, timeout=900):
    """Starts two torch ranks and compares the four ways to train.

    Args:
        progress: callable taking the fraction of the work done.
        workload: `"lm"` (the GPT-style LM) or `"mlp"` (the MLP stack).
        sizes: the model's shape (`benchmarks.suite.LM` or `MLP`).
        batch: batch size (every rank sees the whole batch: TP).
        steps: training steps per timed repetition.
        repeats: timed rounds.
        timeout: seconds before `launch` stops the ranks.

    Returns:
        `{"rows": [...], "data": {...}}` from rank 0.
    """
    return keras_tp.launch(
        _rank,
        world_size=2,
        kwargs=dict(
            progress=progress,
            workload=workload,
            sizes=sizes,
            batch=batch,
            steps=steps,
            repeats=repeats,
        ),
        timeout=timeout,
    )


def _rank(progress, workload, sizes, batch, steps, repeats):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.debug import CommDebugMode

    build_keras, build_torch, plan_of, (x, y) = _workload(
        workload, sizes, batch * steps
    )
    # Wrapping joins the process group of the ranks `launch` started.
    tp = models.compile_for_training(
        keras_tp.TensorParallelKeras(build_keras(), world_size=2)
    )
    rank = dist.get_rank()
    cores = usable_cores()
    rank_threads = torch.get_num_threads()
    plain = models.compile_for_training(build_keras()) if rank == 0 else None
    mesh = init_device_mesh("cpu", (2,))
    torch.manual_seed(0)
    module = build_torch()
    native = torch_models.parallelized(module, plan_of(module), mesh)
    native_optimizer = torch.optim.Adam(native.parameters(), lr=1e-3)
    torch.manual_seed(0)
    single = build_torch() if rank == 0 else None
    single_optimizer = (
        torch.optim.Adam(single.parameters(), lr=1e-3) if rank == 0 else None
    )
    batches = [
        (
            torch.from_numpy(x[i : i + batch]),
            torch.from_numpy(y[i : i + batch]).long(),
        )
        for i in range(0, len(x), batch)
    ]

    def keras_epoch(model):
        start = time.perf_counter()
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
        return (time.perf_counter() - start) / steps

    def torch_epoch(model, optimizer):
        start = time.perf_counter()
        for inputs, targets in batches:
            torch_models.train_step(model, optimizer, inputs, targets)
        return (time.perf_counter() - start) / steps

    def on_rank_zero_with_all_cores(run_one):
        # Rank 1 sleeps in the barrier; rank 0 takes every core, as a
        # one-process program would.
        if rank != 0:
            return 0.0
        torch.set_num_threads(cores)
        try:
            return run_one()
        finally:
            torch.set_num_threads(rank_threads)

    def together(run_one):
        dist.barrier()
        seconds = run_one()
        dist.barrier()
        return seconds

    candidates = {
        "keras_tp TP=2": lambda: together(lambda: keras_epoch(tp)),
        "PyTorch TP=2": lambda: together(
            lambda: torch_epoch(native, native_optimizer)
        ),
        "Keras one process": lambda: together(
            lambda: on_rank_zero_with_all_cores(lambda: keras_epoch(plain))
        ),
        "PyTorch one process": lambda: together(
            lambda: on_rank_zero_with_all_cores(
                lambda: torch_epoch(single, single_optimizer)
            )
        ),
    }
    times = interleaved(
        candidates,
        repeats,
        warmup=1,
        progress=progress if rank == 0 else None,
    )
    with CommDebugMode() as native_comms:
        torch_models.train_step(native, native_optimizer, *batches[0])
    tp.fit(x[:batch], y[:batch], batch_size=batch, verbose=0)
    keras_tp_comms = tp.communication_stats()
    if rank != 0:
        return None
    name = {"lm": "GPT-style LM", "mlp": "MLP stack"}[workload]
    rows = [
        comparison(
            f"torch keras_tp TP=2, {name}: training step",
            f"PyTorch parallelize_module TP=2, {name}",
            ratio(times, "keras_tp TP=2", "PyTorch TP=2"),
            goal=("<=", 1.0),
        ),
        comparison(
            f"torch keras_tp TP=2, {name}: training step",
            f"Keras, one process ({cores} threads), {name}",
            ratio(times, "keras_tp TP=2", "Keras one process"),
            note=(
                "2 ranks on 2 cores: ideal is 0.5x plus communication; "
                "context for the row above"
            ),
        ),
        comparison(
            f"Keras one process, {name}: training step (context)",
            f"PyTorch one process, {name}",
            ratio(times, "Keras one process", "PyTorch one process"),
            note="Keras' own cost on torch, with no keras_tp in it",
        ),
    ]
    return {
        "rows": rows,
        "data": {
            "workload": workload,
            "model": dict(sizes, batch=batch),
            "threads_per_rank": rank_threads,
            "step_seconds": times,
            "keras_tp_collectives": keras_tp_comms,
            "pytorch_collectives": {
                str(op): count
                for op, count in native_comms.get_comm_counts().items()
            },
        },
    }


def _workload(workload, sizes, samples):
    """The Keras builder, the `torch.nn` builder, its plan, and the data."""
    if workload == "lm":
        return (
            lambda: models.language_model(**sizes),
            lambda: torch_models.LanguageModel(**sizes),
            torch_models.language_model_plan,
            models.language_data(samples, sizes["seq_len"], sizes["vocab"]),
        )
    return (
        lambda: models.mlp_stack(**sizes),
        lambda: torch_models.MLPStack(**sizes),
        torch_models.mlp_plan,
        models.mlp_data(samples, sizes["features"], sizes["classes"]),
    )
