"""Regularized split layers, shared by the backends whose ranks hold
their own slices (torch, JAX with a data axis).

An MLP whose Column and Row kernels carry a regularizer, and whose Column
output carries an activity regularizer: each rank's Keras would penalise
its slice only. The loss a step reports and the weights after it equal
one device's, with Keras' `L2` (a sum over entries, whose ranks' parts
are summed) and with `OrthogonalRegularizer` on the kernels (which reads
the whole kernel, gathered). An orthogonal activity regularizer on the
split output is refused, naming the layer.
"""

import keras
import numpy as np

import keras_tp

BATCH = 8
STEPS = 2


def mlp(kernel_regularizer, activity_regularizer=None, seed=0):
    """A built MLP, `8 -> 16 -> 4`, its kernels regularized."""
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(
        16,
        activation="relu",
        kernel_regularizer=kernel_regularizer(),
        activity_regularizer=activity_regularizer,
        name="up",
    )(inputs)
    outputs = keras.layers.Dense(
        4, kernel_regularizer=kernel_regularizer(), name="down"
    )(hidden)
    return keras.Model(inputs, outputs)


REGULARIZERS = {
    "l2": lambda: keras.regularizers.L2(0.1),
    "orthogonal": lambda: keras.regularizers.OrthogonalRegularizer(0.1),
}


def runs(world_size, data_parallel=1):
    """Trains each regularized MLP `STEPS` SGD steps, split and on one
    device.

    Returns:
        `{name: (reported losses, one device's, largest weight
        difference)}`, and under `"refused"` the message of the refused
        activity regularizer.
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 8)).astype("float32")
    y = rng.normal(size=(BATCH, 4)).astype("float32")
    activity = keras.regularizers.L2(0.05)
    results = {}
    for name, regularizer in REGULARIZERS.items():
        reference = mlp(regularizer, activity)
        tp = keras_tp.TensorParallelKeras(
            mlp(regularizer, activity),
            world_size=world_size,
            data_parallel=data_parallel,
        )
        losses = []
        for model in (reference, tp):
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
            losses.append(
                [float(model.train_on_batch(x, y)) for _ in range(STEPS)]
            )
        difference = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(reference.get_weights(), tp.get_weights())
        )
        results[name] = (losses[1], losses[0], difference)
    orthogonal = keras.regularizers.OrthogonalRegularizer(0.1)
    tp = keras_tp.TensorParallelKeras(
        mlp(REGULARIZERS["l2"], orthogonal),
        world_size=world_size,
        data_parallel=data_parallel,
    )
    tp.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    try:
        tp.train_on_batch(x, y)
    except keras_tp.ShardingError as error:
        results["refused"] = str(error)
    return results


def check_runs(results):
    """Asserts what `runs` measured: one device's losses and weights, and
    the refusal naming the layer."""
    for name in REGULARIZERS:
        losses, expected, difference = results[name]
        np.testing.assert_allclose(losses, expected, rtol=1e-5, err_msg=name)
        assert difference < 1e-5, (name, difference)
    assert "Layer 'up' has an activity_regularizer" in results["refused"]
