"""Pipelines whose stages tensor parallelism splits, on TensorFlow.

Run alone, in a process of its own (8 logical CPUs): `KERAS_BACKEND=
tensorflow python -m pytest tests/test_tensorflow_pipeline_3d.py`.
Each stage is a `tf.distribute` strategy over its `data x model` devices
(`keras_tp.runtime.tensorflow.split_stages`); one traced step runs the
schedule's actions as those strategies' replica steps, next to the same
model on one device.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import pytest  # noqa: E402

if keras.backend.backend() != "tensorflow":
    pytest.skip(
        "TensorFlow tests; run with KERAS_BACKEND=tensorflow",
        allow_module_level=True,
    )

import keras_tp  # noqa: E402

keras_tp.configure_virtual_devices(8)

from tests import checkpoint_cases  # noqa: E402
from tests import models  # noqa: E402
from tests import pipeline_cases  # noqa: E402
from tests.pipeline_cases import MICROBATCHES  # noqa: E402


def _stage_slots(tp):
    """The Adam slots of every stage's own optimizer."""
    return [
        variable
        for stage in tp._runtime.stage_optimizers
        for variable in stage.optimizer.variables
        if variable.name.endswith(("_momentum", "_velocity"))
    ]


def test_replicas_of_stages_split_by_tensor_parallelism():
    """data x pipe x model, 2 x 2 x 2 on 8 devices, ZeRO-1: see
    `pipeline_cases.check_split_stage_replicas` (DDP runs in the tied
    embedding's test below). Each stage updates its shards with its own
    copy of the compiled optimizer; the compiled one counts the steps."""
    tp = pipeline_cases.check_split_stage_replicas(
        1, _stage_slots, pipeline_cases.dense_adam
    )
    assert int(tp.optimizer.iterations) == 2
    # Each stage's actions are timed on its first device, from when their
    # inputs are ready to when every replica's outputs are.
    pipeline_cases.check_measured_timeline(
        tp.pipeline_timeline(), "1f1b", MICROBATCHES
    )


def test_replicas_of_split_stages_share_the_tied_embedding():
    """GPT2's CausalLM, 2 replicas x 2 stages x 2-way tensor parallelism,
    DDP: each replica's last stage refreshes its copy of the tied
    embedding's shards from its own first stage (see
    `pipeline_cases.check_split_causal_lm`)."""
    tp, embedding = pipeline_cases.check_split_causal_lm(2, 2, 0)
    shard = embedding.shape[0] // 2 * embedding.shape[1] * 4
    held = tp._runtime.device_bytes([embedding])
    assert list(held.values()) == [shard] * 8
    # Per step, each stage all-reduces its gradients over its 2 replicas
    # once: the shared embedding's from both stages, added on the first.
    combined = tp.communication_stats(axis="data")
    assert list(combined) == ["all_reduce"]
    assert combined["all_reduce"]["calls"] == 2
    assert combined["all_reduce"]["optimizer_calls"] == 2


def test_sharded_checkpoints_of_split_stages_load_at_any_layout(tmp_path):
    """2 replicas x 2 stages x 2-way tensor parallelism, ZeRO-1: each
    device writes its stage's shards and its partition of their Adam
    slots, keyed as one device's optimizer keys them; a fresh pipeline and
    one device load them, and the pipeline loads one device's
    checkpoint."""
    checkpoint_cases.check_three_dimensional_round_trip(str(tmp_path))


def test_global_clipnorm_spans_every_stage():
    """2 replicas x 2 stages x 2-way tensor parallelism, ZeRO-1: each
    stage's optimizer synchronises its replicas' gradients, whose squared
    norm, summed over the stage's devices, goes to the last stage's
    first device; the scale of their sum comes back to every device."""
    tp = keras_tp.TensorParallelKeras(
        models.mlp(),
        world_size=8,
        pipeline_parallel=2,
        data_parallel=2,
        zero_stage=1,
    )
    difference = pipeline_cases.whole_variable_updates_difference(
        tp, pipeline_cases.global_clipped
    )
    assert difference < 1e-6
    sent = tp.communication_stats("train", axis="pipe")["send"]
    # Two squared norms out, two scales back to a stage's 4 devices.
    assert sent["optimizer_calls"] == 4
    assert sent["optimizer_bytes"] == 2 * (4 + 4 * 4)
