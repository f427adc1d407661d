"""keras_tp: real tensor parallelism for Keras 3.

The public names load on first use, so that a program (the demo, the
`keras-tp` command) can choose `KERAS_BACKEND` after `import keras_tp` and
before Keras itself is imported.
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "AsyncDataParallel": "keras_tp.asynchronous",
    "Channelwise": "keras_tp.plan",
    "CheckpointError": "keras_tp.errors",
    "Column": "keras_tp.plan",
    "Compression": "keras_tp.parallel",
    "CoordinatedOptimizer": "keras_tp.parallel",
    "ExpertParallel": "keras_tp.plan",
    "ParallelConfig": "keras_tp.config",
    "RankLostError": "keras_tp.errors",
    "RankStuckError": "keras_tp.errors",
    "Replicate": "keras_tp.plan",
    "Row": "keras_tp.plan",
    "ShardingError": "keras_tp.errors",
    "ShardingPlan": "keras_tp.plan",
    "ShardingStyle": "keras_tp.plan",
    "TensorParallelKeras": "keras_tp.model",
    "Vocab": "keras_tp.plan",
    "auto_plan": "keras_tp.plan",
    "collectives": "keras_tp.collectives",
    "configure_virtual_devices": "keras_tp.runtime",
    "elastic_world_size": "keras_tp.elastic",
    "initialize_distributed": "keras_tp.runtime.distributed",
    "launch": "keras_tp.launcher",
    "pipeline": "keras_tp.pipeline",
    "ray": "keras_tp.ray",
    "load_checkpoint": "keras_tp.checkpoint",
    "restart_count": "keras_tp.elastic",
    "save_checkpoint": "keras_tp.checkpoint",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'keras_tp' has no attribute {name!r}")
    module = importlib.import_module(_EXPORTS[name])
    # Subpackages are exported whole.
    value = (
        module
        if name in ("collectives", "pipeline", "ray")
        else getattr(module, name)
    )
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
