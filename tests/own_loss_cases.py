"""A model whose class computes its own loss, shared by every backend.

keras-hub's SigLIP, BASNet, RetinaNet, PARSeq and D-FINE define
`compute_loss`; SigLIP's makes its own targets and calls the model again
(`self(x)`), then hands them to Keras' `compute_loss` through `super()`.
`PairedTowers` does the same on a model small enough to train in a test:
two Dense towers, split as a Column and a Row each, and a learnt scale
of their products that stays whole. Its loss is a sum over samples, so
data-parallel rows may compute it on their own samples.
"""

import keras
import numpy as np
from keras import ops

import keras_tp

BATCH = 8
FEATURES = 8


class Scale(keras.layers.Layer):
    """Multiplies its input by one learnt number (SigLIP's temperature)."""

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(), initializer="ones")

    def call(self, x):
        return x * self.scale


class TargetsFromInputs(keras.Model):
    """Scores each feature of a sample's two inputs; its `compute_loss`
    makes the targets, the signs of input `b`, and compares them with the
    outputs of the step's forward pass."""

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        targets = ops.cast(x["b"] > 0, y_pred.dtype)
        return super().compute_loss(
            x=x,
            y=targets,
            y_pred=y_pred,
            sample_weight=sample_weight,
            training=training,
        )


class PairedTowers(TargetsFromInputs):
    """As `TargetsFromInputs`, but its loss calls the model again, as
    SigLIP's does."""

    def compute_loss(
        self, x=None, y=None, y_pred=None, sample_weight=None, training=True
    ):
        logits = self(x, training=training)
        return super().compute_loss(
            x=x, y_pred=logits, sample_weight=sample_weight, training=training
        )


def towers(seed=0, calls_again=True):
    """A built `PairedTowers` (or, without `calls_again`, a
    `TargetsFromInputs`), its weights drawn from `seed`."""
    keras.utils.set_random_seed(seed)
    inputs = {name: keras.Input((FEATURES,), name=name) for name in ("a", "b")}
    embedded = []
    for name, tower_input in inputs.items():
        hidden = keras.layers.Dense(16, activation="relu", name=f"{name}_up")
        down = keras.layers.Dense(FEATURES, name=f"{name}_down")
        embedded.append(down(hidden(tower_input)))
    products = embedded[0] * embedded[1]
    logits = Scale(name="temperature")(products)
    model_class = PairedTowers if calls_again else TargetsFromInputs
    return model_class(inputs, logits, name="paired_towers")


def batch(seed=1):
    rng = np.random.default_rng(seed)
    return {
        name: rng.normal(size=(BATCH, FEATURES)).astype("float32")
        for name in ("a", "b")
    }


def _compiled(model):
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.BinaryCrossentropy(from_logits=True),
    )
    return model


def runs(world_size, calls_again=True, **wrap_kwargs):
    """Two training steps and an evaluation of the towers (see `towers`)
    on one device and split `world_size` ways.

    Returns:
        `{"reference": ..., "split": ...}`, each `{"losses", "evaluated"}`;
        `"weights"`, the largest difference of the trained weights;
        `"temperature"`, why the scale stays whole; `"styles"`, each split
        layer's style.
    """
    x = batch()
    reference = _compiled(towers(calls_again=calls_again))
    tp = _compiled(
        keras_tp.TensorParallelKeras(
            towers(calls_again=calls_again),
            world_size=world_size,
            **wrap_kwargs,
        )
    )
    results = {}
    for key, model in (("reference", reference), ("split", tp)):
        results[key] = {
            "losses": [float(model.train_on_batch(x)) for _ in range(2)],
            "evaluated": float(model.evaluate(x, verbose=0)),
        }
    results["weights"] = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(tp.get_weights(), reference.get_weights())
    )
    results["temperature"] = tp.sharding_plan.replicated["temperature"]
    results["styles"] = {
        entry.layer.path: type(entry.style).__name__
        for entry in tp.sharding_plan.leaf_layers()
    }
    return results


def check_runs(results, tolerance=1e-5):
    reference, split = results["reference"], results["split"]
    # The second loss shows a step was taken, and taken alike.
    assert reference["losses"][0] != reference["losses"][1], results
    np.testing.assert_allclose(
        split["losses"], reference["losses"], atol=tolerance
    )
    np.testing.assert_allclose(
        split["evaluated"], reference["evaluated"], atol=tolerance
    )
    assert results["weights"] <= tolerance, results
    assert results["styles"]["a_up"] == "Column", results["styles"]
    assert results["styles"]["a_down"] == "Row", results["styles"]
    # One number is no bank of experts, whatever ExpertParallel needs.
    assert results["temperature"].startswith(
        "Scale: kept whole, as no split of its own weights"
    ), results["temperature"]


def tensorflow_refusal(world_size):
    """On TensorFlow, what training and evaluating `PairedTowers` give.

    Returns:
        `{"error": the training step's error message, "evaluated":
        (one device's, split) losses}`.
    """
    x = batch()
    reference = _compiled(towers())
    tp = _compiled(
        keras_tp.TensorParallelKeras(towers(), world_size=world_size)
    )
    try:
        tp.train_on_batch(x)
        error = None
    except NotImplementedError as refused:
        error = str(refused)
    evaluated = [
        float(model.evaluate(x, verbose=0)) for model in (reference, tp)
    ]
    return {"error": error, "evaluated": evaluated}
