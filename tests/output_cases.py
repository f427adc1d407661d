"""A model that returns one tensor as two of its outputs, on every backend.

keras-hub's D-FINE returns its decoder's last hidden state both as
`last_hidden_state` and as the last of `decoder_hidden_states`. A step
that takes the loss's gradient with respect to the outputs (TensorFlow's,
outside the replicas; a pipeline's last stage) gets the whole gradient at
each place of such a tensor; fed back as output gradients, the places add
up again. Before `keras_tp.tensors.counted_once`, TensorFlow trained such
a model 73% off one device's update, silently.
"""

import keras
import numpy as np

import keras_tp

BATCH = 8
FEATURES = 16


def twice_returned(seed=0):
    """A Megatron pair whose output the model returns twice, and a head."""
    keras.utils.set_random_seed(seed)
    x = keras.Input((4, FEATURES))
    h = keras.layers.Dense(32, activation="relu", name="up")(x)
    h = keras.layers.Dense(FEATURES, name="down")(h)
    head = keras.layers.Dense(FEATURES, name="head")(h)
    return keras.Model(x, (h, h, head), name="twice_returned")


def _data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(BATCH, 4, FEATURES)).astype("float32")
    y = tuple(
        rng.normal(size=(BATCH, 4, FEATURES)).astype("float32")
        for _ in range(3)
    )
    return x, y


def _update(model):
    """The weights' change in one SGD step of the outputs' mean squares."""
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    before = model.get_weights()
    model.train_on_batch(*_data())
    return [a - b for a, b in zip(model.get_weights(), before)]


def runs(world_size, **wrap_kwargs):
    """`{"update": size, "difference": largest}`: the largest change of a
    weight on one device, and the largest difference of the split
    model's changes from it."""
    reference = _update(twice_returned())
    split = _update(
        keras_tp.TensorParallelKeras(
            twice_returned(), world_size=world_size, **wrap_kwargs
        )
    )
    return {
        "update": max(float(np.abs(u).max()) for u in reference),
        "difference": max(
            float(np.abs(a - b).max()) for a, b in zip(split, reference)
        ),
    }


def check_runs(results, tolerance=1e-6):
    assert results["update"] > 1e-3, results  # a step was taken
    assert results["difference"] <= tolerance, results
