"""Pipeline stages on JAX (`keras_tp.runtime.jax.pipeline`), 2 devices.

Run alone: `KERAS_BACKEND=jax python -m pytest tests/test_jax_pipeline.py`.
Each stage of the test MLP is compiled for its own virtual CPU device and
runs the GPipe or 1F1B order, with Adam, next to the same model trained
on one device.
"""

import os

import pytest

if os.environ.get("KERAS_BACKEND", "jax") != "jax":
    pytest.skip("JAX tests run with KERAS_BACKEND=jax", allow_module_level=True)
os.environ["KERAS_BACKEND"] = "jax"

import keras_tp  # noqa: E402

keras_tp.configure_virtual_devices(4)

import jax  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_tp.runtime.jax.pipeline import JaxPipeline  # noqa: E402
from keras_tp.stats import CommunicationStats  # noqa: E402
from tests import pipeline_cases  # noqa: E402
from tests.pipeline_cases import MICROBATCHES  # noqa: E402
from tests.pipeline_cases import STEPS  # noqa: E402


def _train(stage_models, loss, x, y, schedule, steps=STEPS):
    """Trains the stages with Adam, each on its own device, `steps` batches.

    Returns:
        `(losses, pipeline, what the stages sent)`.
    """
    devices = jax.devices()[: len(stage_models)]
    for stage, device in zip(stage_models, devices):
        for variable in stage.variables:
            variable.assign(jax.device_put(variable.value, device))
    stats = CommunicationStats()
    pipeline = JaxPipeline(
        stage_models, devices, loss, schedule, MICROBATCHES, stats
    )
    optimizers = [keras.optimizers.Adam(1e-2) for _ in stage_models]
    losses = []
    for x_batch, y_batch in pipeline_cases.batches(x, y, steps):
        with stats.recording("train"):
            value, gradients, _ = pipeline.step(
                [
                    [v.value for v in s.trainable_variables]
                    for s in stage_models
                ],
                [
                    [v.value for v in s.non_trainable_variables]
                    for s in stage_models
                ],
                x_batch,
                y_batch,
            )
        losses.append(float(value))
        for stage, optimizer, grads, device in zip(
            stage_models, optimizers, gradients, devices
        ):
            # Each stage computed on its own device only.
            assert {d for g in grads for d in g.devices()} == {device}
            optimizer.apply(grads, stage.trainable_variables)
    return losses, pipeline, stats.summary(axis="pipe")["send"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_matches_one_device_and_sends_the_boundary(schedule):
    loss, reference, logged, x, y = pipeline_cases.mlp_reference()
    stage_models = pipeline_cases.mlp_stages()
    losses, pipeline, sent = _train(stage_models, loss, x, y, schedule)
    pipeline_cases.check_weights(reference, stage_models)
    assert np.mean(losses) == pytest.approx(logged, rel=1e-5)
    pipeline_cases.check_mlp_traffic(sent)
    # GPipe holds every micro-batch's activations; 1F1B at most as many as
    # the stages from this one to the last.
    expected = [MICROBATCHES] * 2 if schedule == "gpipe" else [2, 1]
    assert pipeline.peak_activations == expected


def test_a_keras_hub_backbone_carries_its_padding_mask():
    """GPT2's blocks all read the padding mask: stage 0 passes it on, as
    an integer tensor without a gradient."""
    loss, reference, split, x, y = pipeline_cases.backbone_reference()
    stage_models = [stage.model for stage in split.stages]
    _, _, sent = _train(stage_models, loss, x, y, "1f1b", steps=2)
    pipeline_cases.check_weights(reference, stage_models)
    pipeline_cases.check_backbone_traffic(sent, split)
