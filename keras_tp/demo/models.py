"""A small GPT-style language model and synthetic data, made in code."""

import keras
import numpy as np
from keras import layers


@keras.saving.register_keras_serializable(package="keras_tp")
class PositionEmbedding(layers.Layer):
    """Learned position embeddings, looked up with an `Embedding` sublayer.

    Args:
        seq_len: the longest sequence.
        dim: embedding width.
    """

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
        return {
            **super().get_config(),
            "seq_len": self.seq_len,
            "dim": self.dim,
        }


def transformer_lm(
    vocab=64, seq_len=8, dim=16, heads=4, blocks=2, seed=0, dropout=0.0
):
    """A functional pre-LayerNorm transformer LM with a causal mask.

    Args:
        vocab: vocabulary size.
        seq_len: sequence length.
        dim: model width.
        heads: attention heads.
        blocks: transformer blocks.
        seed: seed of the initial weights.
        dropout: rate of the attention dropout and of Dropout layers in
            the MLP (on its hidden features) and after each block's
            attention; 0 adds none.

    Returns:
        A built `keras.Model` from int token ids to logits.
    """
    keras.utils.set_random_seed(seed)
    tokens = keras.Input((seq_len,), dtype="int32", name="tokens")
    x = layers.Embedding(vocab, dim, name="token_embedding")(tokens)
    positions = PositionEmbedding(seq_len, dim, name="position_embedding")(x)
    x = layers.Add(name="embed_add")([x, positions])
    for i in range(blocks):
        h = layers.LayerNormalization(name=f"block{i}_ln1")(x)
        h = layers.MultiHeadAttention(
            heads, dim // heads, dropout=dropout, name=f"block{i}_attention"
        )(h, h, use_causal_mask=True)
        if dropout:
            h = layers.Dropout(dropout, name=f"block{i}_attention_dropout")(h)
        x = layers.Add(name=f"block{i}_add1")([x, h])
        h = layers.LayerNormalization(name=f"block{i}_ln2")(x)
        h = layers.Dense(4 * dim, activation="gelu", name=f"block{i}_mlp_up")(h)
        if dropout:
            h = layers.Dropout(dropout, name=f"block{i}_mlp_dropout")(h)
        h = layers.Dense(dim, name=f"block{i}_mlp_down")(h)
        x = layers.Add(name=f"block{i}_add2")([x, h])
    x = layers.LayerNormalization(name="final_ln")(x)
    logits = layers.Dense(vocab, name="lm_head")(x)
    return keras.Model(tokens, logits, name="transformer_lm")


def counting_sequences(samples, vocab=64, seq_len=8, seed=1):
    """Sequences that count up by a per-sequence stride, modulo `vocab`.

    Returns:
        `(inputs, targets)`: int32 arrays of shape `(samples, seq_len)`,
        the targets being the inputs shifted by one position.
    """
    rng = np.random.default_rng(seed)
    start = rng.integers(0, vocab, (samples, 1))
    stride = rng.integers(1, 4, (samples, 1))
    tokens = (start + stride * np.arange(seq_len + 1)) % vocab
    return tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32")
