"""Pipelines on TensorFlow: stages whole on one device, or split over several.

`pipeline_runtime` picks the runtime of `TensorParallelKeras(
pipeline_parallel=P, ...)`: `TensorFlowPipelineRuntime`
(`whole_stages`) where each replica runs each stage whole on one device,
and `SplitStagesRuntime` (`split_stages`) where tensor parallelism
splits the stages or ZeRO partitions their optimizer state.
"""

from keras_tp.runtime.tensorflow.split_stages import SplitStagesRuntime
from keras_tp.runtime.tensorflow.whole_stages import TensorFlowPipelineRuntime


def pipeline_runtime(
    model,
    pipeline_parallel,
    world_size=None,
    device_ids=None,
    data_parallel=1,
    zero_stage=0,
    *args,
    **kwargs,
):
    """The pipeline runtime for these arguments (those of
    `PipelineRuntime`)."""
    if world_size is None:
        world_size = (
            len(device_ids) if device_ids else pipeline_parallel * data_parallel
        )
    split = world_size > pipeline_parallel * data_parallel or zero_stage
    runtime = SplitStagesRuntime if split else TensorFlowPipelineRuntime
    return runtime(
        model,
        pipeline_parallel,
        world_size,
        device_ids,
        data_parallel,
        zero_stage,
        *args,
        **kwargs,
    )


PIPELINE_RUNTIME = pipeline_runtime
