"""Item 6: the collectives of one training step, against the textbook.

Counted by keras_tp's `communication_stats()` (every collective it issues,
by kind, direction and bytes; on JAX checked against the compiled HLO):

- tensor parallelism, per transformer block: the LM with one block and
  with two, the difference being one block's cost. Megatron's minimum is
  two all-reduces of `batch x sequence x hidden` floats forward and two
  backward;
- data parallelism over Psi parameters, in bytes of the buffers each rank
  hands to its collectives: DDP all-reduces Psi, ZeRO-1 and 2
  reduce-scatter Psi and all-gather Psi (2 Psi), ZeRO-3 gathers the
  parameters forward and again backward and reduce-scatters the gradients
  (3 Psi).

The same code runs on JAX (virtual devices) and on torch (two processes).
"""

import keras

import keras_tp
from benchmarks import models
from benchmarks.timing import comparison

# Why ZeRO-3 moves less than DeepSpeed's 3 Psi on each backend.
ZERO3_NOTE = {
    "jax": (
        "; XLA keeps each forward gather for the backward pass instead of "
        "gathering again (less traffic, the gathered parameters stay in "
        "memory through the step)"
    ),
    "torch": (
        "; the backward pass gathers again only the partitions autograd "
        "reads (all-gathers beyond one per variable)"
    ),
}


def run(progress, sizes, batch, zero_stages, timeout=900):
    """Counts the collectives on this process' backend.

    Args:
        progress: callable taking the fraction of the work done.
        sizes: the LM's shape; `blocks` is ignored (1 and 2 are built).
        batch: global batch.
        zero_stages: ZeRO stages measured at data_parallel=2.
        timeout: seconds before torch's ranks are stopped.

    Returns:
        `{"rows": [...], "data": {...}}`.
    """
    kwargs = dict(
        progress=progress, sizes=sizes, batch=batch, zero_stages=zero_stages
    )
    if keras.backend.backend() == "torch":
        return keras_tp.launch(
            _measure_all, world_size=2, kwargs=kwargs, timeout=timeout
        )
    return _measure_all(**kwargs)


def _measure_all(progress, sizes, batch, zero_stages):
    backend = keras.backend.backend()
    x, y = models.language_data(batch, sizes["seq_len"], sizes["vocab"])
    shape = dict(sizes, blocks=1)
    steps = [(1, 1, 0), (2, 1, 0)] + [(1, 2, s) for s in zero_stages]
    counted = []
    for index, (blocks, data, stage) in enumerate(steps):
        counted.append(
            _one_step(dict(shape, blocks=blocks), x, y, batch, data, stage)
        )
        if counted[-1] is not None:  # torch rank 1 keeps quiet.
            progress((index + 1) / len(steps))
    if counted[0] is None:
        return None  # torch rank 1: rank 0 reports.
    one_block, two_blocks = counted[0], counted[1]
    activation = batch * sizes["seq_len"] * sizes["dim"] * 4
    per_block = {
        direction: two_blocks["model"]
        .get("all_reduce", {})
        .get(f"{direction}_calls", 0)
        - one_block["model"].get("all_reduce", {}).get(f"{direction}_calls", 0)
        for direction in ("forward", "backward")
    }
    block_bytes = sum(
        two_blocks["model"].get("all_reduce", {}).get(f"{d}_bytes", 0)
        - one_block["model"].get("all_reduce", {}).get(f"{d}_bytes", 0)
        for d in ("forward", "backward")
    )
    rows = [
        comparison(
            f"{backend} TP=2: all-reduces per block, {direction}",
            "Megatron: 2",
            per_block[direction],
            goal=("==", 2),
            unit="calls",
        )
        for direction in ("forward", "backward")
    ]
    rows.append(
        comparison(
            f"{backend} TP=2: bytes all-reduced per block",
            "Megatron: 4 x batch x sequence x hidden floats",
            block_bytes / (4 * activation),
            goal=("==", 1),
        )
    )
    expected = {0: 1, 1: 2, 2: 2, 3: 3}
    for entry in counted[2:]:
        psi_bytes = 4 * entry["parameters"]
        moved = sum(
            kind.get("optimizer_bytes", 0)
            + kind.get("backward_bytes", 0)
            + kind.get("forward_bytes", 0)
            for name, kind in entry["data"].items()
            if name in ("all_reduce", "reduce_scatter", "all_gather")
        )
        stage = entry["zero_stage"]
        name = "DDP" if stage == 0 else f"ZeRO-{stage}"
        rows.append(
            comparison(
                f"{backend} {name}, DP=2: bytes through collectives per step",
                f"{expected[stage]} Psi ({'DDP' if stage == 0 else 'ZeRO'})",
                moved / (expected[stage] * psi_bytes),
                goal=("within", 0.01),
                note=(
                    f"in units of Psi: {moved / psi_bytes:.3f}; calls "
                    + ", ".join(
                        f"{kind} {value['calls']}"
                        for kind, value in entry["data"].items()
                    )
                    + (ZERO3_NOTE[backend] if stage == 3 else "")
                ),
            )
        )
    return {
        "rows": rows,
        "data": {
            "model": dict(sizes, batch=batch),
            "activation_bytes": activation,
            "steps": counted,
        },
    }


def _one_step(sizes, x, y, batch, data_parallel, zero_stage):
    """Trains one step; returns the collectives by axis, on rank 0."""
    model = models.language_model(**sizes)
    # Psi, counted before the model is split (a split variable's shape is
    # its local one on torch and TensorFlow).
    parameters = sum(int(keras.ops.size(v)) for v in model.trainable_variables)
    tp = keras_tp.TensorParallelKeras(
        model,
        world_size=2,
        data_parallel=data_parallel,
        zero_stage=zero_stage,
    )
    models.compile_for_training(tp)
    tp.fit(x, y, batch_size=batch, verbose=0)
    if keras.backend.backend() == "torch":
        import torch.distributed as dist

        if dist.get_rank() != 0:
            return None
    entry = {
        "blocks": sizes["blocks"],
        "data_parallel": data_parallel,
        "zero_stage": zero_stage,
        "parameters": parameters,
        "model": tp.communication_stats(axis="model"),
        "data": tp.communication_stats(axis="data"),
    }
    if keras.backend.backend() == "jax":
        from benchmarks import jax_steps

        entry["hlo"] = jax_steps.hlo_collectives(
            jax_steps.compiled_train_step(tp, x, y)
        )
    return entry
