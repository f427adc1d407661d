"""Small models and data used by the tests, the demo and the benchmarks."""

import keras
import numpy as np
from keras import layers


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
            layers.Conv2D(8, 3, padding="same", activation="relu", name="conv1"),
            layers.Conv2D(8, 3, padding="same", name="conv2"),
            layers.MaxPooling2D(name="pool"),
            layers.Flatten(name="flatten"),
            layers.Dense(16, activation="relu", name="fc1"),
            layers.Dense(classes, name="fc2"),
        ],
        name="cnn",
    )


def transformer_lm(seed=0, vocab=64, seq_len=8, dim=16, heads=4, blocks=2):
    """A GPT-style functional LM: token+position embeddings, pre-LN blocks."""
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((seq_len,), dtype="int32", name="tokens")
    x = layers.Embedding(vocab, dim, name="token_embedding")(tokens)
    positions = PositionEmbedding(seq_len, dim, name="position_embedding")(x)
    x = layers.Add(name="embed_add")([x, positions])
    for i in range(blocks):
        h = layers.LayerNormalization(name=f"block{i}_ln1")(x)
        h = layers.MultiHeadAttention(
            heads, dim // heads, name=f"block{i}_attention"
        )(h, h, use_causal_mask=True)
        x = layers.Add(name=f"block{i}_add1")([x, h])
        h = layers.LayerNormalization(name=f"block{i}_ln2")(x)
        h = layers.Dense(4 * dim, activation="gelu", name=f"block{i}_mlp_up")(h)
        h = layers.Dense(dim, name=f"block{i}_mlp_down")(h)
        x = layers.Add(name=f"block{i}_add2")([x, h])
    x = layers.LayerNormalization(name="final_ln")(x)
    logits = layers.Dense(vocab, name="lm_head")(x)
    return keras.Model(tokens, logits, name="transformer_lm")


@keras.saving.register_keras_serializable(package="keras_tp_tests")
class PositionEmbedding(layers.Layer):
    """Learned positions, looked up with an Embedding sublayer."""

    def __init__(self, seq_len, dim, **kwargs):
        super().__init__(**kwargs)
        self.seq_len = seq_len
        self.dim = dim
        self.table = layers.Embedding(seq_len, dim, name="table")

    def build(self, input_shape):
        self.table.build((None,))

    def call(self, x):
        positions = keras.ops.arange(keras.ops.shape(x)[1])
        return keras.ops.expand_dims(self.table(positions), 0)

    def get_config(self):
        return {**super().get_config(), "seq_len": self.seq_len, "dim": self.dim}


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


def data_for(name, batch=16, seed=1):
    """`(x, y)` for the model builder `name`, made in code."""
    rng = np.random.default_rng(seed)
    if name == "mlp":
        return rng.normal(size=(batch, 16)).astype("float32"), rng.integers(0, 8, batch)
    if name == "cnn":
        return rng.normal(size=(batch, 8, 8, 3)).astype("float32"), rng.integers(0, 8, batch)
    if name == "transformer_lm":
        tokens = rng.integers(0, 64, (batch, 9))
        return tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32")
    if name == "subclassed":
        return rng.normal(size=(batch, 12)).astype("float32"), rng.integers(0, 8, batch)
    raise ValueError(name)


BUILDERS = {
    "mlp": mlp,
    "cnn": cnn,
    "transformer_lm": transformer_lm,
    "subclassed": subclassed,
}
