"""`ParallelConfig` checks its arguments once, without devices, against
the support matrix of each backend. Backend-neutral: each case names its
backend."""

import keras
import pytest

from keras_tp.config import SUPPORT
from keras_tp.config import ParallelConfig


def test_sizes_are_derived_and_stage_configs_are_a_stage_mesh():
    config = ParallelConfig(
        world_size=8, data_parallel=2, pipeline_parallel=2, zero_stage=1
    )
    assert config.tensor_parallel == 2
    assert ParallelConfig().requested_world_size is None
    assert ParallelConfig(pipeline_parallel=3).requested_world_size == 3
    stage = config.stage_config(["cpu:0", "cpu:1", "cpu:4", "cpu:5"])
    assert (stage.pipeline_parallel, stage.tensor_parallel) == (1, 2)
    assert stage.device_ids == ("cpu:0", "cpu:1", "cpu:4", "cpu:5")
    assert "data 2 x pipe 2 x model 2" in config.describe()


@pytest.mark.parametrize(
    "arguments, message",
    [
        (dict(zero_stage=4), "zero_stage must be 0, 1, 2 or 3"),
        (dict(data_parallel=0), "data_parallel must be an integer >= 1"),
        (dict(pipeline_parallel=1.5), "pipeline_parallel must be an integer"),
        (dict(num_microbatches=2), "are arguments of a pipeline"),
        (dict(world_size=6, data_parallel=4), "not divisible by data_parallel"),
        (dict(world_size=4, pipeline_parallel=3), "divisible by pipeline_par"),
        (dict(pipeline_parallel=2, zero_stage=1), "and there is one"),
        (
            dict(pipeline_parallel=2, data_parallel=2, schedule="zb"),
            "schedule must be one of",
        ),
        (
            dict(pipeline_parallel=2, data_parallel=2, num_microbatches=0),
            "num_microbatches must be an integer >= 1 or None",
        ),
    ],
)
def test_arguments_are_refused_with_the_fix(arguments, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(backend="jax", **arguments)


@pytest.mark.parametrize("backend", sorted(SUPPORT["sequence_parallel"]))
@pytest.mark.parametrize("data_parallel, zero_stage", [(1, 0), (2, 1), (2, 3)])
def test_sequence_parallelism_follows_the_matrix(
    backend, data_parallel, zero_stage
):
    support = SUPPORT["sequence_parallel"][backend]
    runs = (support.replicas or data_parallel == 1) and (
        zero_stage in support.zero_stages
    )
    arguments = dict(
        world_size=4,
        data_parallel=data_parallel,
        zero_stage=zero_stage,
        sequence_parallel=True,
        backend=backend,
    )
    if runs:
        ParallelConfig(**arguments)
    else:
        with pytest.raises(ValueError, match="Pass sequence_parallel=False"):
            ParallelConfig(**arguments)


def test_pipelines_take_zero_1_at_most():
    with pytest.raises(ValueError, match="Pass zero_stage=1, which partitions"):
        ParallelConfig(pipeline_parallel=2, data_parallel=2, zero_stage=2)


def test_a_device_mesh_gives_the_devices_and_the_data_axis():
    # A mesh names its devices; the config only reads the names.
    devices = [f"cpu:{i}" for i in range(4)]
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices)
    config = ParallelConfig(device_ids=mesh)
    assert (config.data_parallel, config.tensor_parallel) == (2, 2)
    assert config.device_ids == tuple(devices)
    model_only = keras.distribution.DeviceMesh((4,), ["model"], devices)
    assert ParallelConfig(device_ids=model_only).tensor_parallel == 4
    with pytest.raises(ValueError, match="leave data_parallel out"):
        ParallelConfig(device_ids=mesh, data_parallel=4)


def test_a_global_distribution_is_refused_with_the_fix():
    devices = keras.distribution.list_devices()[:1]
    distribution = keras.distribution.DataParallel(devices=devices)
    with distribution.scope():
        with pytest.raises(ValueError, match="set_distribution.None"):
            ParallelConfig(world_size=2)
