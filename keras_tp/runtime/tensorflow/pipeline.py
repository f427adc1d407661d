"""Pipelines on TensorFlow: stages whole on one device, or split over several.

`pipeline_runtime` picks the runtime of `TensorParallelKeras(
pipeline_parallel=P, ...)`: `TensorFlowPipelineRuntime`
(`whole_stages`) where each replica runs each stage whole on one device,
and `SplitStagesRuntime` (`split_stages`) where tensor parallelism
splits the stages or ZeRO partitions their optimizer state
(`ParallelConfig.splits_stages`).
"""

from keras_tp.runtime.tensorflow.split_stages import SplitStagesRuntime
from keras_tp.runtime.tensorflow.whole_stages import TensorFlowPipelineRuntime


def pipeline_runtime(model, config):
    """The pipeline runtime of `model` for `config` (a `ParallelConfig`)."""
    if config.splits_stages:
        return SplitStagesRuntime(model, config)
    return TensorFlowPipelineRuntime(model, config)


PIPELINE_RUNTIME = pipeline_runtime
