"""The Keras models and data of the benchmarks, made in code.

Two workloads, as issue #14 names them: a GPT-style language model (the
demo's pre-LayerNorm transformer LM: token and position embeddings,
causal multi-head attention, a GELU MLP, an LM head) and a stack of MLP
blocks. `benchmarks/torch_models.py` writes the same two in plain
`torch.nn` for PyTorch's own tensor parallelism.
"""

import keras
import numpy as np

from keras_tp.demo.models import counting_sequences
from keras_tp.demo.models import transformer_lm


def language_model(dim, blocks, heads, seq_len, vocab, seed=0):
    """The GPT-style LM, built, with weights drawn from `seed`."""
    return transformer_lm(
        vocab=vocab,
        seq_len=seq_len,
        dim=dim,
        heads=heads,
        blocks=blocks,
        seed=seed,
    )


def language_data(samples, seq_len, vocab):
    """`(tokens, next tokens)`, int32 arrays of shape `(samples, seq_len)`."""
    return counting_sequences(samples, vocab=vocab, seq_len=seq_len)


def mlp_stack(features, blocks, classes, seed=0):
    """Residual MLP blocks `x + down(gelu(up(x)))`, then a linear head.

    Args:
        features: width of the residual stream; `up` is 4x as wide.
        blocks: number of MLP blocks.
        classes: outputs of the head.
        seed: seed of the initial weights.

    Returns:
        A built `keras.Model` from `(batch, features)` to logits.
    """
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((features,), name="features")
    x = inputs
    for i in range(blocks):
        h = keras.layers.Dense(
            4 * features, activation="gelu", name=f"block{i}_up"
        )(x)
        h = keras.layers.Dense(features, name=f"block{i}_down")(h)
        x = keras.layers.Add(name=f"block{i}_add")([x, h])
    logits = keras.layers.Dense(classes, name="head")(x)
    return keras.Model(inputs, logits, name="mlp_stack")


def mlp_data(samples, features, classes, seed=1):
    """Gaussian features and random integer labels."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((samples, features)).astype("float32")
    y = rng.integers(0, classes, (samples,)).astype("int32")
    return x, y


def compile_for_training(model, learning_rate=1e-3, **kwargs):
    """Adam and sparse cross-entropy on logits: what every benchmark trains.

    `kwargs` go to `compile()` (`jit_compile`, say).
    """
    model.compile(
        optimizer=keras.optimizers.Adam(learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        **kwargs,
    )
    return model
