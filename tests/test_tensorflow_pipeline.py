"""Pipeline stages on TensorFlow (`keras_tp.runtime.tensorflow.pipeline`).

Run alone:
`KERAS_BACKEND=tensorflow python -m pytest tests/test_tensorflow_pipeline.py`.
Each stage of the model runs on its own logical CPU device inside one
traced step, in the GPipe or 1F1B order, with Adam, next to the same
model trained on one device.
"""

import os
import re

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import pytest  # noqa: E402

if keras.backend.backend() != "tensorflow":
    pytest.skip(
        "TensorFlow tests; run with KERAS_BACKEND=tensorflow",
        allow_module_level=True,
    )

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_tp  # noqa: E402

keras_tp.configure_virtual_devices(4)

from keras_tp.runtime.tensorflow.pipeline import TensorFlowPipeline  # noqa: E402
from keras_tp.stats import CommunicationStats  # noqa: E402
from tests import pipeline_cases  # noqa: E402
from tests.pipeline_cases import MICROBATCHES  # noqa: E402
from tests.pipeline_cases import STEPS  # noqa: E402

DEVICES = ["/device:CPU:0", "/device:CPU:1"]


def _train(stage_models, loss, x, y, schedule, steps=STEPS):
    """Trains the stages with Adam, `steps` batches.

    Returns:
        `(losses, what the stages sent, the traced step's graph)`.
    """
    stats = CommunicationStats()
    pipeline = TensorFlowPipeline(
        stage_models, DEVICES, loss, schedule, MICROBATCHES, stats
    )
    optimizers = [keras.optimizers.Adam(1e-2) for _ in stage_models]
    losses = []
    for x_batch, y_batch in pipeline_cases.batches(x, y, steps):
        value, gradients = pipeline.step(x_batch, y_batch)
        losses.append(float(value))
        for stage, optimizer, grads in zip(stage_models, optimizers, gradients):
            optimizer.apply(grads, stage.trainable_variables)
    graph = pipeline.step.get_concrete_function(x_batch, y_batch).graph
    return losses, stats.summary(axis="pipe")["send"], graph


def _stage_devices(graph, stage_models):
    """The devices of the matmuls of each stage's layers in `graph`."""
    devices = []
    for stage in stage_models:
        names = {layer.name for layer in stage.layers if layer.weights}
        devices.append(
            {
                tf.DeviceSpec.from_string(op.device).device_index
                for op in graph.get_operations()
                if op.type == "MatMul"
                and any(
                    re.search(rf"/{name}(_\d+)?/", op.name) for name in names
                )
            }
        )
    return devices


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_matches_one_device_on_each_stages_device(schedule):
    loss, reference, logged, x, y = pipeline_cases.mlp_reference()
    stage_models = pipeline_cases.mlp_stages()
    losses, sent, graph = _train(stage_models, loss, x, y, schedule)
    pipeline_cases.check_weights(reference, stage_models)
    assert np.mean(losses) == pytest.approx(logged, rel=1e-5)
    pipeline_cases.check_mlp_traffic(sent)
    # Forward and backward matmuls of stage s run on device s only.
    assert _stage_devices(graph, stage_models) == [{0}, {1}]


def test_a_keras_hub_backbone_carries_its_padding_mask():
    """GPT2's blocks all read the padding mask: stage 0 passes it on, as
    an integer tensor without a gradient."""
    # The pipeline sums each stage's gradients over the micro-batches,
    # densely; Keras would give the one-device oracle's embedding
    # gradient as `IndexedSlices`, which Adam treats row by row.
    optimizer = keras.optimizers.Adam(1e-2)
    apply = optimizer.apply
    optimizer.apply = lambda grads, variables=None: apply(
        [tf.convert_to_tensor(g) for g in grads], variables
    )
    loss, reference, split, x, y = pipeline_cases.backbone_reference(optimizer)
    stage_models = [stage.model for stage in split.stages]
    _, sent, _ = _train(stage_models, loss, x, y, "1f1b", steps=2)
    pipeline_cases.check_weights(reference, stage_models)
    pipeline_cases.check_backbone_traffic(sent, split)
