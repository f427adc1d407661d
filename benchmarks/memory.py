"""Item 5: memory per device, measured from the arrays, against the ideal.

On JAX, with 8 virtual CPU devices, the LM is trained one step:

- split by tensor parallelism over 1, 2, 4 and 8 devices: the parameters
  and Adam state each device stores (`parameter_bytes_per_device()` and
  `optimizer_bytes_per_device()`, which read every array's
  `addressable_shards`) against the ideal, the one-device total / N;
- with ZeRO stages 0-3 over a data axis: what each device keeps between
  steps against DeepSpeed's formulas for float32 Adam (Psi parameters).
  DeepSpeed counts 4 Psi of parameters, 4 Psi of gradients and 8 Psi of
  Adam state, each divided by N from its stage on (stage 0 16 Psi,
  stage 1 4 Psi + 4 Psi + 8 Psi / N, stage 2 4 Psi + 12 Psi / N, stage 3
  16 Psi / N), as if the gradients stayed resident. keras_tp keeps the
  parameters and Adam state between steps, and gradients only to
  accumulate micro-batches (`gradient_accumulation_steps > 1`), as plain
  Keras keeps none: so kept bytes are compared with DeepSpeed's
  parameter and Adam terms, and kept gradient bytes (0 here) with its
  gradient term apart.

A step's gradients are transient: each device computes its whole local
gradient (up to 4 Psi of its tensor-parallel shard, before any
reduce-scatter) inside the step, and frees it when the step ends. They
show in the peak of the step (activations included), from the compiled
step's `memory_analysis()`. On torch, `census()` counts each rank's
storages instead.
"""

import keras_tp
from benchmarks import jax_steps
from benchmarks import models
from benchmarks.timing import comparison


def run(progress, sizes, batch, world_sizes, data_parallel, zero_stages):
    """Measures the bytes per device of each configuration.

    Args:
        progress: callable taking the fraction of the work done.
        sizes: the LM's shape.
        batch: global batch of the one training step.
        world_sizes: tensor-parallel sizes to measure.
        data_parallel: data-parallel sizes for the ZeRO stages.
        zero_stages: ZeRO stages to measure.

    Returns:
        `{"rows": [...], "data": {...}}`.
    """
    x, y = models.language_data(batch, sizes["seq_len"], sizes["vocab"])
    configurations = [(n, 1, 0) for n in world_sizes] + [
        (d, d, s) for d in data_parallel for s in zero_stages
    ]
    one_device = models.compile_for_training(models.language_model(**sizes))
    one_device.fit(x, y, batch_size=batch, verbose=0)
    parameters = sum(
        int(v.numpy().size) for v in one_device.trainable_variables
    )
    total = {
        "parameters": _largest(one_device.variables),
        "optimizer": _largest(one_device.optimizer.variables),
        "peak": jax_steps.step_memory(
            jax_steps.compiled_train_step(one_device, x, y)
        )["peak"],
    }
    measured = []
    for index, (world, data, stage) in enumerate(configurations):
        measured.append(_measure(sizes, x, y, batch, world, data, stage))
        progress((index + 1) / len(configurations))

    rows = []
    for entry in measured:
        world, data, stage = (
            entry["world_size"],
            entry["data_parallel"],
            entry["zero_stage"],
        )
        if data == 1:
            ideal = (total["parameters"] + total["optimizer"]) / world
            resident = entry["parameters"] + entry["optimizer"]
            rows.append(
                comparison(
                    f"jax TP={world}: parameters + Adam state, largest device",
                    "ideal: one device's / N",
                    resident / ideal,
                    goal=("<=", 1.03),
                    note=f"{resident:,} B against {ideal:,.0f} B",
                )
            )
            rows.append(
                comparison(
                    f"jax TP={world}: peak of the compiled step, per device",
                    "one device's peak / N",
                    entry["peak"] / (total["peak"] / world),
                    note="activations of replicated layers are not split",
                )
            )
            continue
        formula = zero_formula(parameters, stage, data)
        kept = entry["parameters"] + entry["gradients"] + entry["optimizer"]
        resident = formula["parameters"] + formula["optimizer"]
        rows.append(
            comparison(
                f"jax ZeRO-{stage}, DP={data}: bytes kept between steps "
                "(parameters + Adam), largest device",
                "DeepSpeed's parameter + Adam terms (float32)",
                kept / resident,
                goal=("within", 0.03),
                note=(
                    "kept = parameters + Adam state, and gradients only "
                    "while accumulating (gradient_accumulation_steps > 1): "
                    f"{kept:,} B against {resident:,.0f} B; DeepSpeed's "
                    "total, which counts the gradients as resident, is "
                    f"{sum(formula.values()):,.0f} B"
                ),
            )
        )
        rows.append(
            comparison(
                f"jax ZeRO-{stage}, DP={data}: gradient bytes kept between "
                "steps, largest device",
                "DeepSpeed's gradient term, counted resident",
                entry["gradients"] / formula["gradients"],
                goal=("==", 0.0),
                note=(
                    f"{entry['gradients']:,} B against "
                    f"{formula['gradients']:,.0f} B: gradients are kept "
                    "only with gradient_accumulation_steps > 1; a step's "
                    "own live only in the step"
                ),
            )
        )
        rows.append(
            comparison(
                f"jax ZeRO-{stage}, DP={data}: peak of the compiled step, "
                "per device",
                "bytes kept between steps",
                entry["peak"] / kept,
                note=(
                    f"{entry['peak']:,} B: the step's transient local "
                    f"gradient (up to 4 Psi = {4 * parameters:,} B), "
                    "activations and collective buffers come on top"
                ),
            )
        )
    return {
        "rows": rows,
        "data": {
            "model": dict(sizes, batch=batch),
            "parameters": parameters,
            "one_device_bytes": total,
            "configurations": measured,
            "convention": CONVENTION,
        },
    }


CONVENTION = (
    "Kept bytes are what a device holds between steps, read from the "
    "arrays: parameters and optimizer state, and gradients only while "
    "accumulating micro-batches (gradient_accumulation_steps > 1). "
    "DeepSpeed's formulas count the gradients as resident; here a step's "
    "gradients are transient and show in its peak (memory_analysis())."
)


def zero_formula(parameters, stage, data_parallel):
    """DeepSpeed's bytes per device for float32 Adam, by ZeRO stage.

    Args:
        parameters: Psi, the number of trainable parameters.
        stage: the ZeRO stage, 0 to 3.
        data_parallel: N, the ranks that partition the states.

    Returns:
        `{"parameters", "gradients", "optimizer"}`: bytes of parameters
        (4 Psi), gradients (4 Psi) and Adam's two moments (8 Psi), each
        divided by N from its stage on (the optimizer state from stage 1,
        the gradients from 2, the parameters at 3).
    """
    psi, n = parameters, data_parallel
    return {
        "parameters": 4 * psi / n if stage >= 3 else 4 * psi,
        "gradients": 4 * psi / n if stage >= 2 else 4 * psi,
        "optimizer": 8 * psi / n if stage >= 1 else 8 * psi,
    }


def _measure(sizes, x, y, batch, world_size, data_parallel, zero_stage):
    tp = keras_tp.TensorParallelKeras(
        models.language_model(**sizes),
        world_size=world_size,
        data_parallel=data_parallel,
        zero_stage=zero_stage,
    )
    models.compile_for_training(tp)
    tp.fit(x, y, batch_size=batch, verbose=0)
    peak = jax_steps.step_memory(jax_steps.compiled_train_step(tp, x, y))
    return {
        "world_size": world_size,
        "data_parallel": data_parallel,
        "zero_stage": zero_stage,
        "parameters": max(tp.parameter_bytes_per_device().values()),
        "gradients": max(tp.gradient_bytes_per_device().values()),
        "optimizer": max(tp.optimizer_bytes_per_device().values()),
        "peak": peak["peak"],
        "step_memory": peak,
    }


def _largest(variables):
    return max(jax_steps.bytes_per_device(variables).values())
