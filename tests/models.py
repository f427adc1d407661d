"""Small models and data used by the tests, the demo and the benchmarks."""

import keras
import numpy as np
from keras import layers

from keras_tp.demo.models import transformer_lm


def loss_fn():
    """The loss every test trains with: the models output logits."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def max_diff(a, b):
    """Largest absolute difference between two lists of arrays."""
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))))
        for x, y in zip(a, b)
    )


def mlp(seed=0, features=16, hidden=32, classes=8):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,))
    x = layers.Dense(hidden, activation="relu", name="up")(inputs)
    x = layers.Dense(hidden, activation="relu", name="down")(x)
    outputs = layers.Dense(classes, name="head")(x)
    return keras.Model(inputs, outputs, name="mlp")


def cnn(seed=0, classes=8):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((8, 8, 3)),
            # No bias before BatchNormalization: its gradient is zero, and
            # Adam would turn float noise on it into lr-sized steps.
            layers.Conv2D(8, 3, padding="same", use_bias=False, name="conv1"),
            # Its statistics follow conv1's split channels (Channelwise).
            layers.BatchNormalization(name="bn1"),
            layers.ReLU(name="relu1"),
            layers.Conv2D(8, 3, padding="same", name="conv2"),
            layers.MaxPooling2D(name="pool"),
            layers.Flatten(name="flatten"),
            layers.Dense(16, activation="relu", name="fc1"),
            layers.Dense(classes, name="fc2"),
        ],
        name="cnn",
    )


@keras.saving.register_keras_serializable(package="keras_tp_tests")
class ResidualMLP(layers.Layer):
    """A subclassed block: LayerNorm, Dense up (gelu), Dense down, residual."""

    def __init__(self, dim, hidden, **kwargs):
        super().__init__(**kwargs)
        self.dim = dim
        self.hidden = hidden
        self.norm = layers.LayerNormalization(name="norm")
        self.up = layers.Dense(hidden, activation="gelu", name="up")
        self.down = layers.Dense(dim, name="down")

    def build(self, input_shape):
        self.norm.build(input_shape)
        self.up.build(input_shape)
        self.down.build(input_shape[:-1] + (self.hidden,))

    def call(self, x):
        return x + self.down(self.up(self.norm(x)))

    def get_config(self):
        return {**super().get_config(), "dim": self.dim, "hidden": self.hidden}


@keras.saving.register_keras_serializable(package="keras_tp_tests")
class SubclassedNet(keras.Model):
    """A subclassed model of subclassed blocks."""

    def __init__(self, dim=16, hidden=32, classes=8, **kwargs):
        super().__init__(**kwargs)
        self.dim, self.hidden, self.classes = dim, hidden, classes
        self.stem = layers.Dense(dim, name="stem")
        self.block1 = ResidualMLP(dim, hidden, name="block1")
        self.block2 = ResidualMLP(dim, hidden, name="block2")
        self.head = layers.Dense(classes, name="head")

    def build(self, input_shape):
        self.stem.build(input_shape)
        self.block1.build(input_shape[:-1] + (self.dim,))
        self.block2.build(input_shape[:-1] + (self.dim,))
        self.head.build(input_shape[:-1] + (self.dim,))

    def call(self, x):
        return self.head(self.block2(self.block1(self.stem(x))))

    def get_config(self):
        return {
            **super().get_config(),
            "dim": self.dim,
            "hidden": self.hidden,
            "classes": self.classes,
        }


def subclassed(seed=0):
    keras.utils.set_random_seed(seed)
    model = SubclassedNet(name="subclassed")
    model.build((None, 12))
    return model


def gpt2_backbone(seed=0, length=8):
    """A tiny keras-hub `GPT2Backbone`, whose blocks all read the mask."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    return keras_hub.models.GPT2Backbone(
        vocabulary_size=64,
        num_layers=2,
        num_heads=2,
        hidden_dim=16,
        intermediate_dim=32,
        max_sequence_length=length,
        dropout=0.0,
    )


def backbone_data(batch, length=8, seed=0):
    """Token ids, a full padding mask and hidden-state targets."""
    rng = np.random.default_rng(seed)
    x = {
        "token_ids": rng.integers(0, 64, (batch, length)).astype("int32"),
        "padding_mask": np.ones((batch, length), "int32"),
    }
    y = rng.normal(size=(batch, length, 16)).astype("float32")
    return x, y


def data_for(name, batch=16, seed=1):
    """`(x, y)` for the model builder `name`, made in code."""
    rng = np.random.default_rng(seed)
    if name == "mlp":
        return rng.normal(size=(batch, 16)).astype("float32"), rng.integers(
            0, 8, batch
        )
    if name == "cnn":
        return rng.normal(size=(batch, 8, 8, 3)).astype(
            "float32"
        ), rng.integers(0, 8, batch)
    if name == "transformer_lm":
        tokens = rng.integers(0, 64, (batch, 9))
        return tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32")
    if name == "subclassed":
        return rng.normal(size=(batch, 12)).astype("float32"), rng.integers(
            0, 8, batch
        )
    raise ValueError(name)


BUILDERS = {
    "mlp": mlp,
    "cnn": cnn,
    "transformer_lm": lambda seed=0: transformer_lm(seed=seed),
    "subclassed": subclassed,
}
