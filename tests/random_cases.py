"""Dropout masks of split and whole activations, shared by every backend.

The probe model has three dropouts, each made visible in an output:

- attention dropout inside a split attention layer: two heads with
  identical weights, each writing its own half of the output, so the two
  halves are equal exactly when both heads drew the same mask;
- a Dropout between a Column layer and its Row partner (identity kernels):
  each half of the output is one rank's half of the mask;
- the same Dropout layer called again on a whole (replicated) activation,
  which every rank must mask alike (keras-hub's ViT MLP reuses one
  Dropout so).

On one device all masks are drawn independently, so the halves differ;
they must differ in the parallel model too, and every rank must return
the same (replicated) outputs.
"""

import keras
import numpy as np
from keras import layers

RATE = 0.5
SEQ = 4
DIM = 8
BATCH = 16


def probe_model():
    """The model of the module docstring, with weights that expose masks."""
    keras.utils.set_random_seed(7)
    inputs = keras.Input((SEQ, DIM))
    attention = layers.MultiHeadAttention(
        2, DIM // 2, dropout=RATE, name="attention"
    )
    attended = attention(inputs, inputs)
    up = layers.Dense(DIM, name="up")(inputs)
    dropout = layers.Dropout(RATE, name="dropout")
    down = layers.Dense(DIM, name="down")(dropout(up))
    whole = dropout(inputs)
    model = keras.Model(inputs, [attended, down, whole], name="dropouts")
    half = DIM // 2
    for name in ("up", "down"):
        model.get_layer(name).set_weights([np.eye(DIM), np.zeros(DIM)])
    # Uniform attention (zero queries and keys); head h copies input
    # features [0, half) into output features [h * half, (h + 1) * half).
    value = np.zeros((DIM, 2, half))
    output = np.zeros((2, half, DIM))
    for head in range(2):
        value[:half, head] = np.eye(half)
        output[head, :, head * half : (head + 1) * half] = np.eye(half)
    weights = []
    for variable in attention.weights:
        name = variable.path.split("/")[-2]
        shape = tuple(variable.shape)
        if name == "value" and len(shape) == 3:
            weights.append(value)
        elif name == "attention_output" and len(shape) == 3:
            weights.append(output)
        else:
            weights.append(np.zeros(shape))
    attention.set_weights(weights)
    return model


def inputs():
    return np.ones((BATCH, SEQ, DIM), "float32")


def masked_outputs(model):
    """The three outputs of one training-mode call, as NumPy arrays."""
    return [
        np.asarray(keras.ops.convert_to_numpy(output))
        for output in model(inputs(), training=True)
    ]


def per_rank_calls(model):
    """`{layer name: (split, ...)}` of the plan's per-rank random layers."""
    plan = model.sharding_plan
    return {layer.name: calls for layer, calls in plan.per_rank_random.items()}


def check_masks(outputs):
    """Each split dropout drew a mask per part; the whole one dropped.

    Args:
        outputs: the outputs of `masked_outputs`.
    """
    attended, split, whole = outputs
    half = DIM // 2
    for name, value in (("attention", attended), ("split", split)):
        first, second = value[..., :half], value[..., half:]
        assert not np.array_equal(first, second), (
            f"{name} dropout drew one mask for both parts"
        )
        # Each part is a real dropout: some dropped, some kept.
        for part in (first, second):
            assert 0 < np.mean(part == 0) < 1, (name, np.mean(part == 0))
    assert 0.3 < np.mean(whole == 0) < 0.7, np.mean(whole == 0)


def check_same_on_every_rank(per_rank):
    """Every rank returns the same outputs: replicated masks agree.

    Args:
        per_rank: `masked_outputs` of each rank.
    """
    for rank, outputs in enumerate(per_rank[1:], start=1):
        for reference, output in zip(per_rank[0], outputs):
            np.testing.assert_array_equal(output, reference, f"rank {rank}")
