"""A zoo of tiny, offline, deterministic models for the tests.

Every builder here makes a small keras-hub task model (or a
`keras.applications` model) from a hand-written config: no presets, no
downloads, random float32 weights. Each builder calls
`keras.utils.set_random_seed(seed)` before it creates a single layer, so two
calls with the same seed give identical weights, and each returns
`(model, x, y)`:

- `model`: a built keras model; keras-hub task models get
  `preprocessor=None`, so they take token ids (or images) directly.
- `x`: a numpy input batch: for text models the dict of arrays the model
  takes (batch 4, sequence 8, padding masks all ones), for image models a
  `(4, 32, 32, 3)` float32 array.
- `y`: numpy integer labels: token ids shaped `(4, 8)` for language models,
  class ids shaped `(4,)` for classifiers.

The same seed gives the same weights on one backend only: each backend
draws its random numbers differently.

All configurable dropout is 0, so training steps are deterministic. The
keras-hub configs are tiny (hidden 32 or 64, 2 layers, vocabulary 128,
intermediate 64 or 128), so a forward pass costs tens of milliseconds on a
CPU; `resnet50` (23.6M parameters) and `efficientnetb0` (4.0M) keep their
standard architectures and cost 0.1 to 1 second. Head counts
divide by 2 and 4 wherever the family allows, so the models can be split
2 and 4 ways by a tensor-parallel planner; the exceptions are on purpose:
Gemma uses one key/value head (multi-query attention) and Mistral uses two
key/value heads for eight query heads (grouped-query attention).

`ZOO` maps each family name to its builder; `loss_for(name)` gives the loss
to compile that model with (every model here outputs logits).

Example:

    model, x, y = ZOO["gemma"](seed=0)
    model.compile(optimizer="sgd", loss=loss_for("gemma"))
    model.train_on_batch(x, y)
"""

import functools

import keras
import keras_hub
import numpy as np
from keras_hub.src.models.qwen3_5 import qwen3_5_gated_delta_net

# keras-hub's Gated DeltaNet (`qwen3_5`) runs its delta rule in chunks of
# 64 tokens: the zoo's 8-token sequences are padded to 64, and a Python
# loop of 63 steps, each on its own shapes (on JAX eagerly, a compile
# each), costs most of every Qwen3.5 test's time. Chunks of 4 tokens
# compute the same rule (to float32 rounding), over two chunks of the
# zoo's sequences with the state carried between them; keras-hub's layer
# takes no chunk size, so its module's function is given one.
qwen3_5_gated_delta_net._chunk_gated_delta_rule = functools.partial(
    qwen3_5_gated_delta_net._chunk_gated_delta_rule, chunk_size=4
)

BATCH = 4
SEQ_LEN = 8
VOCAB = 128
IMAGE_SHAPE = (32, 32, 3)
NUM_CLASSES = 3


def _rng(seed):
    """A numpy generator for the data, independent of the weight seed."""
    return np.random.default_rng(seed + 1000)


def _token_ids(seed, vocab=VOCAB, shape=(BATCH, SEQ_LEN)):
    """Random token ids in `[0, vocab)`, int32."""
    return _rng(seed).integers(0, vocab, size=shape).astype("int32")


def _lm_data(seed):
    """Inputs and next-token labels for a causal language model.

    Args:
        seed: int. Seed of the data.

    Returns:
        A `(x, y)` tuple: `x` a dict of `token_ids` and `padding_mask`,
        `y` int32 token ids shaped `(BATCH, SEQ_LEN)`.
    """
    ids = _token_ids(seed, shape=(BATCH, SEQ_LEN + 1))
    x = {
        "token_ids": np.ascontiguousarray(ids[:, :-1]),
        "padding_mask": np.ones((BATCH, SEQ_LEN), "int32"),
    }
    return x, np.ascontiguousarray(ids[:, 1:])


def _classifier_data(seed, segment_ids=False):
    """Inputs and class labels for a text classifier.

    Args:
        seed: int. Seed of the data.
        segment_ids: bool. Whether to add all-zero `segment_ids` (BERT).

    Returns:
        A `(x, y)` tuple: `x` a dict of `token_ids` and `padding_mask`
        (and `segment_ids`), `y` int32 class ids shaped `(BATCH,)`.
    """
    x = {
        "token_ids": _token_ids(seed),
        "padding_mask": np.ones((BATCH, SEQ_LEN), "int32"),
    }
    if segment_ids:
        x["segment_ids"] = np.zeros((BATCH, SEQ_LEN), "int32")
    y = _rng(seed + 1).integers(0, NUM_CLASSES, size=(BATCH,))
    return x, y.astype("int32")


def _seq2seq_data(seed):
    """Inputs and labels for an encoder-decoder language model.

    Args:
        seed: int. Seed of the data.

    Returns:
        A `(x, y)` tuple: `x` a dict of `encoder_token_ids`,
        `encoder_padding_mask`, `decoder_token_ids` and
        `decoder_padding_mask`, `y` the decoder ids shifted by one, int32,
        shaped `(BATCH, SEQ_LEN)`.
    """
    encoder_ids = _token_ids(seed)
    decoder_ids = _token_ids(seed + 1, shape=(BATCH, SEQ_LEN + 1))
    ones = np.ones((BATCH, SEQ_LEN), "int32")
    x = {
        "encoder_token_ids": encoder_ids,
        "encoder_padding_mask": ones,
        "decoder_token_ids": np.ascontiguousarray(decoder_ids[:, :-1]),
        "decoder_padding_mask": ones.copy(),
    }
    return x, np.ascontiguousarray(decoder_ids[:, 1:])


def _image_data(seed):
    """Images in `[0, 1)` and class labels for an image classifier.

    Args:
        seed: int. Seed of the data.

    Returns:
        A `(x, y)` tuple: `x` float32 images shaped `(BATCH, 32, 32, 3)`,
        `y` int32 class ids shaped `(BATCH,)`.
    """
    rng = _rng(seed)
    x = rng.random((BATCH,) + IMAGE_SHAPE).astype("float32")
    y = rng.integers(0, NUM_CLASSES, size=(BATCH,)).astype("int32")
    return x, y


def _causal_lm(seed, family, **config):
    """`(model, x, y)`: keras-hub's `<family>CausalLM` on a `<family>Backbone`
    of 2 blocks over the zoo's vocabulary, with `config`, float32 weights
    drawn from `seed`."""
    keras.utils.set_random_seed(seed)
    backbone = getattr(keras_hub.models, f"{family}Backbone")(
        vocabulary_size=VOCAB, num_layers=2, dtype=None, **config
    )
    task = getattr(keras_hub.models, f"{family}CausalLM")
    model = task(backbone=backbone, preprocessor=None)
    x, y = _lm_data(seed)
    return model, x, y


def gemma(seed=0):
    """A tiny `GemmaCausalLM`: multi-query attention, tied embeddings.

    4 query heads share 1 key/value head (head_dim 16); the output logits
    reuse the token embedding (`ReversibleEmbedding`, tied).

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    return _causal_lm(
        seed,
        "Gemma",
        num_query_heads=4,
        num_key_value_heads=1,
        hidden_dim=64,
        intermediate_dim=128,
        head_dim=16,
        dropout=0.0,
    )


def gpt2(seed=0):
    """A tiny `GPT2CausalLM`: 4 heads, tied embeddings.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    return _causal_lm(
        seed,
        "GPT2",
        num_heads=4,
        hidden_dim=32,
        intermediate_dim=64,
        dropout=0.0,
        max_sequence_length=16,
    )


def falcon(seed=0):
    """A tiny `FalconCausalLM`: 4 heads flattened into features, ALiBi
    biases its decoder block makes for every head, tied embeddings.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    return _causal_lm(
        seed,
        "Falcon",
        num_attention_heads=4,
        hidden_dim=32,
        intermediate_dim=64,
    )


def bloom(seed=0):
    """A tiny `BloomCausalLM`: 4 heads whose ALiBi slopes its attention's
    `AlibiBias` computes from the scores' heads count, tied embeddings.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    return _causal_lm(
        seed,
        "Bloom",
        num_heads=4,
        hidden_dim=32,
        intermediate_dim=64,
    )


def gpt_neox(seed=0):
    """A tiny `GPTNeoXCausalLM`: one fused query/key/value projection of
    4 heads, rotary embeddings on a quarter of each head, untied.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    return _causal_lm(
        seed,
        "GPTNeoX",
        num_heads=4,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=16,
    )


def llama(seed=0):
    """A tiny `LlamaCausalLM`: 4 query and 4 key/value heads, untied.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    return _causal_lm(
        seed,
        "Llama",
        num_query_heads=4,
        num_key_value_heads=4,
        hidden_dim=32,
        intermediate_dim=64,
        dropout=0.0,
        tie_word_embeddings=False,
    )


def mistral(seed=0):
    """A tiny `MistralCausalLM`: grouped-query attention, 8 query heads.

    8 query heads share 2 key/value heads (head_dim 8), untied embeddings.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    return _causal_lm(
        seed,
        "Mistral",
        num_query_heads=8,
        num_key_value_heads=2,
        hidden_dim=64,
        intermediate_dim=128,
        dropout=0.0,
    )


def qwen3(seed=0):
    """A tiny `Qwen3CausalLM`: 8 query and 4 key/value heads, tied.

    Qwen3 normalizes queries and keys per head (RMS norms of size head_dim)
    and ties the output projection to the token embedding.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    return _causal_lm(
        seed,
        "Qwen3",
        num_query_heads=8,
        num_key_value_heads=4,
        head_dim=8,
        hidden_dim=64,
        intermediate_dim=128,
        dropout=0.0,
        tie_word_embeddings=True,
    )


def gemma4(seed=0):
    """A tiny `Gemma4CausalLM`: 4 query heads share 2 key/value heads,
    normed per head, and each block's MLP multiplies by its gate, up and
    down projections' kernels itself (`ops.matmul`), never calling them.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring; `x`
        also holds the `position_ids` Gemma 4 reads.
    """
    model, x, y = _causal_lm(
        seed,
        "Gemma4",
        image_size=16,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=64,
        intermediate_dim=128,
        head_dim=16,
        dropout=0.0,
        sliding_window_size=8,
    )
    positions = np.arange(x["token_ids"].shape[1], dtype="int32")
    x["position_ids"] = np.tile(positions, (x["token_ids"].shape[0], 1))
    return model, x, y


def qwen3_5(seed=0):
    """A tiny `Qwen3_5CausalLM`: a linear-attention block (Gated DeltaNet,
    its query, key and value projected by one layer, block by block, and
    convolved with a weight of its own) before a full-attention one. Its
    delta rule runs in chunks of 4 tokens (see the module's top).

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    return _causal_lm(
        seed,
        "Qwen3_5",
        num_query_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        hidden_dim=32,
        intermediate_dim=64,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
    )


def phi3(seed=0):
    """A tiny `Phi3CausalLM`: 8 query and 8 key/value heads, untied.

    keras-hub's Phi3 keeps separate query, key and value projections and
    separate gate and up feedforward projections (no fused `qkv_proj` or
    `gate_up_proj` as in the Hugging Face checkpoints). Its config differs
    from `llama`'s so the two models do not end up with identical weights.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    return _causal_lm(
        seed,
        "Phi3",
        hidden_dim=64,
        intermediate_dim=128,
        num_query_heads=8,
        num_key_value_heads=8,
        dropout=0.0,
        max_sequence_length=64,
        pretraining_sequence_length=64,
    )


def mixtral(seed=0):
    """A tiny `MixtralCausalLM`: 4 experts, top 2, grouped-query attention.

    8 query heads share 4 key/value heads (head_dim 8). The experts of a
    layer are one `MixtralMoeExperts` layer holding three 3-D kernels of
    shape `(num_experts, ...)`; in training the router adds an auxiliary
    load-balancing loss with `add_loss`.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    return _causal_lm(
        seed,
        "Mixtral",
        num_query_heads=8,
        num_key_value_heads=4,
        hidden_dim=64,
        intermediate_dim=64,
        num_experts=4,
        top_k=2,
        router_jitter_noise=0.0,
        dropout=0.0,
    )


def gpt_oss(seed=0):
    """A tiny `GptOssCausalLM`: attention sinks, 4 experts, top 2.

    4 query heads share 2 key/value heads (head_dim 8); each attention
    layer holds a weight of its own with one value per query head (its
    sinks).

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    return _causal_lm(
        seed,
        "GptOss",
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        num_experts=4,
        top_k=2,
        head_dim=8,
    )


def qwen_moe(seed=0):
    """A tiny `QwenMoeCausalLM`: 4 experts, top 2, and a gated shared
    expert, whose output the block scales in place (`*=`, which changes a
    torch tensor the trace recorded).

    4 query heads share 2 key/value heads (head_dim 8).

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    return _causal_lm(
        seed,
        "QwenMoe",
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        moe_intermediate_dim=16,
        shared_expert_intermediate_dim=32,
        num_experts=4,
        top_k=2,
    )


def gemma3n(seed=0):
    """A tiny `Gemma3nCausalLM` (text only): 4 query and 2 key/value heads,
    per-layer inputs, AltUp and LAuReL blocks. Its graph projects the
    logits with the transpose of the token embedding, taken when the model
    is built (on torch a view of the embedding's storage).

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.Gemma3nBackbone(
        text_vocab_size=VOCAB,
        text_hidden_size=32,
        num_hidden_layers=2,
        pad_token_id=0,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        intermediate_size=[64, 64],
        hidden_activation="gelu_approximate",
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=8,
        rope_theta=10000.0,
        max_position_embeddings=64,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=8,
        altup_num_inputs=2,
        laurel_rank=4,
        activation_sparsity_pattern=[0.0, 0.0],
        dtype=None,
    )
    model = keras_hub.models.Gemma3nCausalLM(
        backbone=backbone, preprocessor=None
    )
    x, y = _lm_data(seed)
    return model, x, y


def distilbert(seed=0):
    """A tiny `DistilBertTextClassifier` with 3 classes and 4 heads.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.DistilBertBackbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_heads=4,
        hidden_dim=32,
        intermediate_dim=64,
        dropout=0.0,
        max_sequence_length=16,
        dtype=None,
    )
    model = keras_hub.models.DistilBertTextClassifier(
        backbone=backbone,
        num_classes=NUM_CLASSES,
        preprocessor=None,
        dropout=0.0,
    )
    x, y = _classifier_data(seed)
    return model, x, y


def roberta(seed=0):
    """A tiny `RobertaTextClassifier` with 3 classes and 4 heads.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.RobertaBackbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_heads=4,
        hidden_dim=32,
        intermediate_dim=64,
        dropout=0.0,
        max_sequence_length=16,
        dtype=None,
    )
    model = keras_hub.models.RobertaTextClassifier(
        backbone=backbone,
        num_classes=NUM_CLASSES,
        preprocessor=None,
        dropout=0.0,
    )
    x, y = _classifier_data(seed)
    return model, x, y


def bert(seed=0):
    """A tiny `BertTextClassifier` with 3 classes and 4 heads.

    Its inputs include `segment_ids` (all zeros here).

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_heads=4,
        hidden_dim=32,
        intermediate_dim=64,
        dropout=0.0,
        max_sequence_length=16,
        num_segments=2,
        dtype=None,
    )
    model = keras_hub.models.BertTextClassifier(
        backbone=backbone,
        num_classes=NUM_CLASSES,
        preprocessor=None,
        dropout=0.0,
    )
    x, y = _classifier_data(seed, segment_ids=True)
    return model, x, y


def fnet(seed=0):
    """A tiny `FNetTextClassifier`: a Fourier transform over the sequence
    and the features mixes tokens in place of attention.

    The transform reads every feature, so the embedding projection
    before it gathers its output rather than pairing through it with
    the first block's feed-forward (`plan/dependence.py`); each block's
    feed-forward is a Megatron pair.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.FNetBackbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        hidden_dim=32,
        intermediate_dim=64,
        dropout=0.0,
        max_sequence_length=16,
        dtype=None,
    )
    model = keras_hub.models.FNetTextClassifier(
        backbone=backbone,
        num_classes=NUM_CLASSES,
        preprocessor=None,
        dropout=0.0,
    )
    x, y = _classifier_data(seed, segment_ids=True)
    del x["padding_mask"]  # FNet takes none
    return model, x, y


def rwkv7(seed=0):
    """A tiny `RWKV7CausalLM`: 4 heads of size 8, no attention.

    Its time mix projects receptance, key and value from the block's
    input mixed with its shifted copy (raw ops), never from one another,
    and raw ops carry all three, head by head, to its output projection:
    one Megatron pair, found only by running the block
    (`plan/dependence.py`).

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.RWKV7Backbone(
        hidden_size=32,
        head_size=8,
        num_layers=2,
        vocabulary_size=VOCAB,
        intermediate_dim=64,
        gate_lora=8,
        mv_lora=8,
        aaa_lora=8,
        decay_lora=8,
    )
    model = keras_hub.models.RWKV7CausalLM(backbone=backbone, preprocessor=None)
    x, y = _lm_data(seed)
    return model, x, y


def roformer_v2(seed=0):
    """A tiny `RoformerV2TextClassifier`: 4 heads of size 8.

    Its attention projects with `Dense` layers, whose kernels fold heads
    and head size into one axis, and reshapes to its `heads` attribute.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.RoformerV2Backbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_heads=4,
        hidden_dim=32,
        intermediate_dim=64,
        head_size=8,
        dropout=0.0,
        dtype=None,
    )
    model = keras_hub.models.RoformerV2TextClassifier(
        backbone=backbone,
        num_classes=NUM_CLASSES,
        preprocessor=None,
        dropout=0.0,
    )
    x, y = _classifier_data(seed, segment_ids=True)
    del x["padding_mask"]  # it masks the padding token id itself
    return model, x, y


def xlnet(seed=0):
    """A tiny `XLNetBackbone` (4 heads of size 8) under a token classifier
    of its own: keras-hub has no XLNet task.

    Its blocks hand their per-head attention biases and segment encoding,
    weights of the block, to the attention's call, which projects its
    relative position encoding to every head as it projects the query.
    The MLP is 96 wide: no attribute of a block is a chance divisor of it.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.XLNetBackbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_heads=4,
        hidden_dim=32,
        intermediate_dim=96,
        dropout=0.0,
    )
    logits = keras.layers.Dense(NUM_CLASSES, name="classifier")(backbone.output)
    model = keras.Model(backbone.input, logits)
    x, _ = _classifier_data(seed, segment_ids=True)
    y = _rng(seed + 1).integers(0, NUM_CLASSES, size=(BATCH, SEQ_LEN))
    return model, x, y.astype("int32")


def vit(seed=0):
    """A tiny `ViTImageClassifier`: 32x32 images, 8x8 patches, 3 classes.

    16 patches plus a class token give a sequence of 17; 4 heads.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.ViTBackbone(
        image_shape=IMAGE_SHAPE,
        patch_size=8,
        num_layers=2,
        num_heads=4,
        hidden_dim=32,
        mlp_dim=64,
        dropout_rate=0.0,
        attention_dropout=0.0,
        dtype=None,
    )
    model = keras_hub.models.ViTImageClassifier(
        backbone=backbone,
        num_classes=NUM_CLASSES,
        preprocessor=None,
        dropout=0.0,
    )
    x, y = _image_data(seed)
    return model, x, y


def swin(seed=0):
    """A tiny `SwinTransformerImageClassifier`: 32x32 images, 4x4 patches.

    Two stages (2 and 4 heads, widths 16 and 32) of one block each over
    windows of 4x4 tokens; each window attention projects its queries,
    keys and values with one `Dense(3 * dim)` laid out block by block
    (`(..., 3, heads, head_dim)`).

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.SwinTransformerBackbone(
        image_shape=IMAGE_SHAPE,
        embed_dim=16,
        depths=(1, 1),
        num_heads=(2, 4),
        window_size=4,
        patch_size=4,
        mlp_ratio=2.0,
        dropout_rate=0.0,
        attention_dropout=0.0,
        drop_path=0.0,
        dtype=None,
    )
    model = keras_hub.models.SwinTransformerImageClassifier(
        backbone=backbone, num_classes=NUM_CLASSES, preprocessor=None
    )
    x, y = _image_data(seed)
    return model, x, y


@keras.saving.register_keras_serializable(package="keras_tp_zoo")
class FusedBlock(keras.layers.Layer):
    """A pre-norm transformer block whose projections are fused block by
    block: one `Dense(3 * dim)` for the queries, keys and values, reshaped
    to `(batch, length, 3, heads, head_dim)` as Swin's and ViTDet's, and
    one `Dense(2 * hidden)` for a SwiGLU MLP's gate and up projections,
    split in two halves."""

    def __init__(self, dim, num_heads, hidden, **kwargs):
        super().__init__(**kwargs)
        self.dim = dim
        self.num_heads = num_heads
        self.hidden = hidden

    def build(self, input_shape):
        self.attention_norm = keras.layers.LayerNormalization(name="norm_1")
        self.qkv = keras.layers.Dense(3 * self.dim, name="qkv")
        self.projection = keras.layers.Dense(self.dim, name="projection")
        self.mlp_norm = keras.layers.LayerNormalization(name="norm_2")
        self.gate_up = keras.layers.Dense(2 * self.hidden, name="gate_up")
        self.down = keras.layers.Dense(self.dim, name="down")
        for layer in (self.attention_norm, self.qkv, self.mlp_norm):
            layer.build(input_shape)
        self.projection.build(input_shape)
        self.gate_up.build(input_shape)
        self.down.build(tuple(input_shape[:-1]) + (self.hidden,))

    def call(self, x):
        batch, length = keras.ops.shape(x)[0], keras.ops.shape(x)[1]
        qkv = self.qkv(self.attention_norm(x))
        qkv = keras.ops.reshape(qkv, (batch, length, 3, self.num_heads, -1))
        query, key, value = keras.ops.unstack(
            keras.ops.transpose(qkv, (2, 0, 3, 1, 4)), axis=0
        )
        scale = (self.dim // self.num_heads) ** -0.5
        scores = keras.ops.matmul(query * scale, keras.ops.swapaxes(key, 2, 3))
        heads = keras.ops.matmul(keras.ops.softmax(scores, axis=-1), value)
        heads = keras.ops.reshape(
            keras.ops.transpose(heads, (0, 2, 1, 3)), (batch, length, -1)
        )
        x = x + self.projection(heads)
        gate, up = keras.ops.split(self.gate_up(self.mlp_norm(x)), 2, axis=-1)
        return x + self.down(keras.ops.silu(gate) * up)

    def get_config(self):
        config = super().get_config()
        config.update(
            dim=self.dim, num_heads=self.num_heads, hidden=self.hidden
        )
        return config


def fused(seed=0):
    """A tiny classifier of 2 `FusedBlock`s (width 32, 4 heads, MLP 64)
    over sequences of 8 float vectors: fused projections laid out block
    by block, as Swin's and ViTDet's attention and SwiGLU MLPs.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        `(model, x, y)`: `x` float32 `(BATCH, SEQ_LEN, 32)`, `y` class ids.
    """
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((SEQ_LEN, 32))
    x = inputs
    for index in range(2):
        x = FusedBlock(32, 4, 64, name=f"block_{index}")(x)
    x = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(NUM_CLASSES, name="head")(x)
    model = keras.Model(inputs, outputs)
    rng = _rng(seed)
    x = rng.standard_normal((BATCH, SEQ_LEN, 32)).astype("float32")
    y = rng.integers(0, NUM_CLASSES, size=(BATCH,)).astype("int32")
    return model, x, y


def fused_lora(seed=0):
    """`fused` with LoRA of rank 4 on its fused projections, their `b`
    factors random (Keras starts them at zero), split by blocks too."""
    model, x, y = fused(seed)
    rng = _rng(seed + 1)
    for index in range(2):
        for name in ("qkv", "gate_up"):
            layer = getattr(model.get_layer(f"block_{index}"), name)
            layer.enable_lora(4)
            layer.lora_kernel_b.assign(
                0.1 * rng.normal(size=layer.lora_kernel_b.shape)
            )
    return model, x, y


def clip(seed=0):
    """A tiny `CLIPBackbone`: a vision and a text encoder, 4 heads each.

    The two encoders name their layers alike, so their variables share
    paths (`encoder_block_0/attention/query/kernel`, ...). The vision
    encoder's 32x32 images in 8x8 patches give 17 positions (with the class
    token), the text encoder's 8. The labels pair image `i` with text `i`:
    CLIP's contrastive loss is the cross-entropy of both similarity
    matrices against their diagonals.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple; `x` holds `images` and `token_ids`, and
        `y` the diagonal labels of both outputs.
    """
    keras.utils.set_random_seed(seed)
    vision = keras_hub.models.CLIPVisionEncoder(
        patch_size=8,
        hidden_dim=32,
        num_layers=2,
        num_heads=4,
        intermediate_dim=64,
        image_shape=IMAGE_SHAPE,
    )
    text = keras_hub.models.CLIPTextEncoder(
        vocabulary_size=VOCAB,
        embedding_dim=32,
        hidden_dim=32,
        num_layers=2,
        num_heads=4,
        intermediate_dim=64,
        max_sequence_length=SEQ_LEN,
    )
    model = keras_hub.models.CLIPBackbone(vision, text, projection_dim=32)
    images, _ = _image_data(seed)
    x = {"images": images, "token_ids": _token_ids(seed)}
    diagonal = np.arange(BATCH, dtype="int32")
    return model, x, {"vision_logits": diagonal, "text_logits": diagonal}


def moonshine(seed=0):
    """A tiny `MoonshineBackbone` (speech to text) and a batch for it.

    Its audio encoder starts with a convolution 127 samples wide and
    strides 64, then two more: the audio must be at least 895 samples
    long, so a probe batch with unknown dimensions of 8 cannot run it.
    Its rotary table, passed to every attention layer, is 4 wide (62% of
    a head's 8 features) beside 4 heads: a heads count by its shape.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x)` tuple; `x` holds 1,024 audio samples and 8 decoder
        tokens per row.
    """
    keras.utils.set_random_seed(seed)
    model = keras_hub.models.MoonshineBackbone(
        vocabulary_size=VOCAB,
        filter_dim=32,
        encoder_num_layers=1,
        decoder_num_layers=1,
        hidden_dim=32,
        intermediate_dim=64,
        encoder_num_heads=4,
        decoder_num_heads=4,
    )
    audio = _rng(seed).normal(size=(BATCH, 1024, 1)).astype("float32")
    x = {
        "encoder_input_values": audio,
        "encoder_padding_mask": np.ones((BATCH, 1024), "bool"),
        "decoder_token_ids": _token_ids(seed),
        "decoder_padding_mask": np.ones((BATCH, SEQ_LEN), "bool"),
    }
    return model, x


def bart(seed=0):
    """A tiny `BartSeq2SeqLM`: encoder-decoder, 4 heads, tied embeddings.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring; `x` is
        the dict of encoder and decoder ids and masks.
    """
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BartBackbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_heads=4,
        hidden_dim=32,
        intermediate_dim=64,
        dropout=0.0,
        max_sequence_length=16,
        dtype=None,
    )
    model = keras_hub.models.BartSeq2SeqLM(backbone=backbone, preprocessor=None)
    x, y = _seq2seq_data(seed)
    return model, x, y


def t5(seed=0):
    """A tiny `T5Seq2SeqLM`: encoder-decoder, 4 heads, tied embeddings.

    Uses gated-GELU feedforward blocks (as in T5 v1.1); the first layer of
    the encoder and of the decoder holds the relative attention bias.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring; `x` is
        the dict of encoder and decoder ids and masks.
    """
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.T5Backbone(
        vocabulary_size=VOCAB,
        num_layers=2,
        num_heads=4,
        hidden_dim=32,
        intermediate_dim=64,
        dropout=0.0,
        activation="gelu",
        use_gated_activation=True,
        tie_embedding_weights=True,
        dtype=None,
    )
    model = keras_hub.models.T5Seq2SeqLM(backbone=backbone, preprocessor=None)
    x, y = _seq2seq_data(seed)
    return model, x, y


def t5gemma(seed=0, family="T5Gemma"):
    """A tiny `T5GemmaSeq2SeqLM`: grouped-query attention (4 query and 2
    key/value heads), tied embeddings.

    Its attention returns its key/value cache in training too, split on
    the heads of a rank that holds its own slices.

    Args:
        seed: int. Seed of the weights and the data.
        family: `"T5Gemma"`, or `"T5Gemma2"`, whose decoder's merged
            attention takes a pair of caches (self and cross attention),
            `(None, None)` in training.

    Returns:
        A `(model, x, y)` tuple, as `t5`'s.
    """
    keras.utils.set_random_seed(seed)
    sizes = {
        "hidden_dim": 32,
        "intermediate_dim": 64,
        "num_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "layer_types": ["full_attention"] * 2,
    }
    backbone = getattr(keras_hub.models, f"{family}Backbone")(
        vocabulary_size=VOCAB,
        **{
            f"{part}_{k}": v
            for part in ("encoder", "decoder")
            for k, v in sizes.items()
        },
        dropout_rate=0.0,
        dtype=None,
    )
    task = getattr(keras_hub.models, f"{family}Seq2SeqLM")
    model = task(backbone=backbone, preprocessor=None)
    x, y = _seq2seq_data(seed)
    return model, x, y


def t5gemma2(seed=0):
    """`t5gemma` of the `T5Gemma2` family."""
    return t5gemma(seed, "T5Gemma2")


def _zero_dropout(model):
    """Sets the rate of every `Dropout` layer of `model` to 0.

    `keras.applications` builders such as `EfficientNetB0` do not expose
    their dropout rates; a `Dropout` layer reads its rate when called, so
    zeroing it after construction turns dropout off.
    """
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, keras.layers.Dropout):
            layer.rate = 0.0
    return model


def resnet50(seed=0):
    """`keras.applications.ResNet50` on 32x32 images, 3 classes, logits.

    Built with `classifier_activation=None`, so it outputs logits. It has
    BatchNormalization layers, whose moving statistics change in training.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    keras.utils.set_random_seed(seed)
    model = keras.applications.ResNet50(
        weights=None,
        input_shape=IMAGE_SHAPE,
        classes=NUM_CLASSES,
        classifier_activation=None,
    )
    x, y = _image_data(seed)
    return model, x, y


def efficientnetb0(seed=0):
    """`keras.applications.EfficientNetB0` on 32x32, 3 classes, logits.

    Built with `classifier_activation=None`, so it outputs logits. Its
    dropout (top dropout and drop-connect, not constructor arguments of
    `EfficientNetB0`) is set to 0 after construction. It starts with
    `Rescaling` and an unadapted `Normalization` layer (mean 0, variance 1)
    and has BatchNormalization layers.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    keras.utils.set_random_seed(seed)
    model = keras.applications.EfficientNetB0(
        weights=None,
        input_shape=IMAGE_SHAPE,
        classes=NUM_CLASSES,
        classifier_activation=None,
    )
    _zero_dropout(model)
    x, y = _image_data(seed)
    return model, x, y


def separable_cnn(seed=0):
    """Xception's block of separable convolutions on 32x32 images, logits.

    SeparableConv2D -> BatchNormalization -> ReLU -> a grouped Conv2D (8
    groups of 2 channels) -> SeparableConv2D (depth multiplier 2) ->
    BatchNormalization, added to a 1x1 Conv2D shortcut; then InceptionV3's
    fan-out (its `mixed9` block: one 1x1 Conv2D read by a 1x3 and a 3x1
    Conv2D, concatenated), MobileNetV2's inverted residual (a 1x1
    expansion, a bias-free depthwise convolution, a 1x1 projection, with
    BatchNormalization and ReLU6 between) with EfficientNet's
    squeeze-and-excitation gate before the projection (pooling, a
    reshape, two 1x1 Conv2D, a multiply), global average pooling and a
    Dense head. `keras.applications.Xception` needs 71x71 images and 23M
    parameters: this keeps its block at the zoo's size.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    images = keras.Input(IMAGE_SHAPE)
    shortcut = layers.Conv2D(16, 1, use_bias=False, name="shortcut")(images)
    x = layers.SeparableConv2D(
        16, 3, padding="same", use_bias=False, name="sepconv1"
    )(images)
    x = layers.BatchNormalization(name="sepconv1_bn")(x)
    x = layers.ReLU(name="sepconv1_relu")(x)
    x = layers.Conv2D(16, 3, padding="same", groups=8, name="grouped")(x)
    x = layers.SeparableConv2D(
        16, 3, padding="same", depth_multiplier=2, name="sepconv2"
    )(x)
    x = layers.BatchNormalization(name="sepconv2_bn")(x)
    x = layers.Add(name="add")([x, shortcut])
    branch = layers.Conv2D(16, 1, activation="relu", name="branch")(x)
    wide = layers.Conv2D(8, (1, 3), padding="same", name="branch_1x3")(branch)
    tall = layers.Conv2D(8, (3, 1), padding="same", name="branch_3x1")(branch)
    x = layers.Concatenate(name="branches")([wide, tall])
    x = layers.Conv2D(32, 1, use_bias=False, name="expand")(x)
    x = layers.BatchNormalization(name="expand_bn")(x)
    x = layers.ReLU(6.0, name="expand_relu")(x)
    x = layers.DepthwiseConv2D(
        3, padding="same", use_bias=False, name="depthwise"
    )(x)
    x = layers.BatchNormalization(name="depthwise_bn")(x)
    x = layers.ReLU(6.0, name="depthwise_relu")(x)
    gate = layers.GlobalAveragePooling2D(name="squeeze")(x)
    gate = layers.Reshape((1, 1, 32), name="squeeze_reshape")(gate)
    gate = layers.Conv2D(8, 1, activation="swish", name="se_reduce")(gate)
    gate = layers.Conv2D(32, 1, activation="sigmoid", name="se_expand")(gate)
    x = layers.Multiply(name="excite")([x, gate])
    x = layers.Conv2D(16, 1, use_bias=False, name="project")(x)
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    logits = layers.Dense(NUM_CLASSES, name="predictions")(x)
    model = keras.Model(images, logits, name="separable_cnn")
    x, y = _image_data(seed)
    return model, x, y


def gemma_lora(seed=0):
    """`gemma` with LoRA of rank 4 on its backbone, as for fine-tuning.

    The adapters' `b` factors start at zero in Keras; here they are random
    so that the merged update shows in the outputs from the first step.

    Args:
        seed: int. Seed of the weights and the data.

    Returns:
        A `(model, x, y)` tuple as described in the module docstring.
    """
    model, x, y = gemma(seed)
    model.backbone.enable_lora(4)
    rng = _rng(seed + 1)
    for variable in model.weights:
        if variable.path.endswith("lora_kernel_b"):
            variable.assign(
                0.1 * rng.normal(size=variable.shape).astype("float32")
            )
    return model, x, y


ZOO = {
    "gemma": gemma,
    "gemma_lora": gemma_lora,
    "gpt2": gpt2,
    "falcon": falcon,
    "bloom": bloom,
    "gpt_neox": gpt_neox,
    "llama": llama,
    "mistral": mistral,
    "qwen3": qwen3,
    "gemma4": gemma4,
    "qwen3_5": qwen3_5,
    "phi3": phi3,
    "mixtral": mixtral,
    "distilbert": distilbert,
    "roberta": roberta,
    "bert": bert,
    "vit": vit,
    "swin": swin,
    "fused": fused,
    "fused_lora": fused_lora,
    "xlnet": xlnet,
    "bart": bart,
    "t5": t5,
    "t5gemma": t5gemma,
    "t5gemma2": t5gemma2,
    "gpt_oss": gpt_oss,
    "qwen_moe": qwen_moe,
    "gemma3n": gemma3n,
    "roformer_v2": roformer_v2,
    "fnet": fnet,
    "rwkv7": rwkv7,
    "clip": clip,
    "resnet50": resnet50,
    "efficientnetb0": efficientnetb0,
    "separable_cnn": separable_cnn,
}


def loss_for(name):
    """The loss to compile the zoo model `name` with.

    Every model in the zoo outputs logits (the keras.applications models
    are built with `classifier_activation=None`), and every label is an
    integer id, so this is sparse categorical crossentropy from logits.

    Args:
        name: str. A key of `ZOO`.

    Returns:
        A `keras.losses.Loss`.

    Raises:
        KeyError: if `name` is not in `ZOO`.
    """
    if name not in ZOO:
        raise KeyError(f"Unknown zoo model {name!r}; known: {sorted(ZOO)}")
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)
