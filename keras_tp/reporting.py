"""What `TensorParallelKeras` reports about how its model is split.

The text of `summary()`, the dict of `get_parallelism_info()` and the
measured pipeline timeline, read from the runtime and the bound plan.
"""

from keras_tp.plan.report import format_plan
from keras_tp.tensors import nbytes


def parallelism_info(runtime, model, plan):
    """`TensorParallelKeras.get_parallelism_info()` (see there)."""
    return {
        "backend": runtime.backend,
        "world_size": runtime.world_size,
        "tensor_parallel": runtime.tensor_parallel,
        "data_parallel": runtime.data_parallel,
        "pipeline_parallel": runtime.pipeline_parallel,
        "zero_stage": runtime.zero_stage,
        "sequence_parallel": runtime.config.sequence_parallel,
        "config": runtime.config.describe(),
        "devices": list(runtime.devices),
        "parameter_bytes_per_device": runtime.device_bytes(model.variables),
        "parameter_bytes_total": full_parameter_bytes(runtime, model),
        "sharded_layers": [entry.layer.path for entry in plan.layers],
        "replicated_layers": dict(plan.replicated),
    }


def summary_lines(runtime, model, plan):
    """The lines of `TensorParallelKeras.summary()`: the plan (a
    pipeline's stages), the parameter bytes and the configuration."""
    if runtime.pipeline_parallel > 1:
        layout = runtime.split.summary()
    else:
        layout = format_plan(plan, runtime.placement.local_shape)
    per_device = runtime.device_bytes(model.variables)
    total = full_parameter_bytes(runtime, model)
    return [
        layout,
        f"Parameters: {_mb(total)} unsplit; per device (measured): "
        + ", ".join(f"{d} {_mb(b)}" for d, b in per_device.items()),
        f"Parallelism: {runtime.config.describe()}",
    ]


def full_parameter_bytes(runtime, model):
    """The bytes of `model`'s variables unsplit."""
    shapes = runtime.placement.full_shapes
    return sum(nbytes(v, shapes[id(v)]) for v in model.variables)


def measured_timeline(runtime):
    """`TensorParallelKeras.pipeline_timeline()` (see there)."""
    if runtime.pipeline_parallel == 1:
        raise ValueError(
            "pipeline_timeline() times the stages of a pipeline: pass "
            "pipeline_parallel > 1 to TensorParallelKeras."
        )
    timeline = runtime.measured_timeline()
    if timeline is None:
        raise ValueError(
            "No training step has run yet: call fit() (or "
            "train_on_batch()) first."
        )
    return timeline


def _mb(size):
    return f"{size / 2**20:.3f} MiB"
