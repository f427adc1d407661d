"""Pipeline runs shared by the JAX, TensorFlow and torch stage tests.

Each test trains the stages of `keras_tp.pipeline.split_stages` with Adam
through its backend's pipeline, next to the same model on one device.
"""

import keras
import numpy as np

from keras_tp.pipeline.stages import split_stages
from tests import models

BATCH = 8
STEPS = 3
MICROBATCHES = 4
LENGTH = 8  # the backbone's sequence length


def mlp_stages():
    """The test MLP as 2 stages of its own layers: `up`, then the rest."""
    split = split_stages(models.mlp(), 2, cut_points=["down"])
    return [stage.model for stage in split.stages]


def mlp_reference():
    """`(loss, reference, its logged loss, x, y)` for `STEPS` batches."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = models.data_for("mlp", batch=BATCH * STEPS)
    reference = models.mlp()
    reference.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    history = reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return loss, reference, history.history["loss"][0], x, y


def backbone_reference(optimizer=None, stages=2):
    """`(loss, reference, split, x, y)` of GPT2's backbone, 2 batches.

    Args:
        optimizer: the reference's optimizer; default `Adam(1e-2)`.
        stages: the number of stages of `split`.
    """
    x, y = models.backbone_data(BATCH * 2, LENGTH)
    loss = keras.losses.MeanSquaredError()
    reference = models.gpt2_backbone(length=LENGTH)
    reference.compile(
        optimizer=optimizer or keras.optimizers.Adam(1e-2), loss=loss
    )
    reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    split = split_stages(models.gpt2_backbone(length=LENGTH), stages)
    return loss, reference, split, x, y


def batches(x, y, steps):
    """`steps` batches of `BATCH` samples of `(x, y)`; `x` may be a dict."""
    for step in range(steps):
        batch = slice(step * BATCH, (step + 1) * BATCH)
        if isinstance(x, dict):
            yield {k: v[batch] for k, v in x.items()}, y[batch]
        else:
            yield x[batch], y[batch]


def check_weights(reference, stage_models):
    """Asserts every stage's weights equal the reference's within 1e-5."""
    expected = dict(
        zip([v.path for v in reference.weights], reference.get_weights())
    )
    for stage in stage_models:
        for variable in stage.trainable_variables:
            np.testing.assert_allclose(
                keras.ops.convert_to_numpy(variable.value),
                expected[variable.path],
                atol=1e-5,
            )


def check_unsplit_weights(reference, weights):
    """Asserts `get_weights()` of a pipelined model equal the reference's
    within 1e-5."""
    for expected, actual in zip(reference.get_weights(), weights, strict=True):
        np.testing.assert_allclose(actual, expected, atol=1e-5)


def mlp_stage_bytes():
    """The bytes of the test MLP's stages cut at `down`: `up`, the rest."""
    layers = {layer.name: layer for layer in models.mlp().layers}
    return [
        sum(w.nbytes for name in names for w in layers[name].get_weights())
        for names in (["up"], ["down", "head"])
    ]


def check_mlp_traffic(sent):
    """One (BATCH / MICROBATCHES, 32) float32 activation per micro-batch
    forward, and its gradient back."""
    assert sent["forward_bytes"] == sent["backward_bytes"] == BATCH * 32 * 4
    assert sent["calls"] == 2 * MICROBATCHES


def check_backbone_traffic(sent, split):
    """At each cut, the hidden states and the carried mask forward; the
    hidden states' gradients back (the integer mask has none)."""
    micro = BATCH // MICROBATCHES
    cuts = split.bytes_per_cut(micro, LENGTH)
    assert sent["forward_bytes"] == MICROBATCHES * sum(cuts)
    assert sent["backward_bytes"] == (
        MICROBATCHES * len(cuts) * micro * LENGTH * 16 * 4
    )
