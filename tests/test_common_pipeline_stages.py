"""`split_stages`: pipeline stages cut from real models.

Every split is checked the same way (`check_split`): the stages, run one
after the other, give the model's outputs exactly; they hold the model's
own variables, each in one stage; their parameters add up to the model's;
what each stage sends is what the next one takes, and the bytes the
boundaries report are those of the arrays actually sent.

Runs on JAX (`KERAS_BACKEND=jax`); nothing here depends on the backend.
"""

import functools
import itertools
import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras  # noqa: E402
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from keras import layers  # noqa: E402

from keras_tp.demo.models import counting_sequences  # noqa: E402
from keras_tp.demo.models import transformer_lm  # noqa: E402
from keras_tp.pipeline import split_stages  # noqa: E402
from tests import pipeline_cases  # noqa: E402
from tests import zoo  # noqa: E402

SEQ_LEN = 8


def flat_numpy(outputs):
    return [np.asarray(t) for t in keras.tree.flatten(outputs)]


def check_split(model, split, x, sequence_length=None):
    """The checks every split must pass; returns the max/min parameters."""
    expected = flat_numpy(model(x, training=False))

    # Chained stages compute the model, exactly.
    outputs = x
    sent = []
    for stage in split.stages:
        outputs = stage.model(outputs, training=False)
        if stage.index < split.num_stages - 1:
            assert sorted(outputs) == sorted(stage.output_names)
            sent.append(outputs)
    got = flat_numpy(outputs)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    for a, b in zip(flat_numpy(split.run(x)), expected):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)

    # The model's own variables, each in exactly one stage.
    owner = {}
    for stage in split.stages:
        for weight in stage.model.weights:
            assert id(weight) not in owner, weight.path
            owner[id(weight)] = stage.index
    assert set(owner) == {id(w) for w in model.weights}
    layer_stage = {}
    for stage in split.stages:
        for layer in stage.model.layers:
            if layer.weights:
                assert id(layer) not in layer_stage, layer.name
                layer_stage[id(layer)] = stage.index
    counts = split.parameter_counts
    assert sum(counts) == model.count_params()
    for stage in split.stages:
        assert stage.parameter_count == stage.model.count_params()

    # What a stage sends is what the next takes, as the boundary says.
    assert len(split.boundaries) == split.num_stages - 1
    batch = len(expected[0])
    for boundary, values in zip(split.boundaries, sent):
        stage, following = split.stages[boundary.index : boundary.index + 2]
        assert boundary.names == stage.output_names
        assert boundary.names == following.input_names
        for tensor in boundary.tensors:
            value = np.asarray(values[tensor.name])
            assert value.dtype == np.dtype(tensor.dtype), tensor.name
            assert len(tensor.shape) == value.ndim, tensor.name
            for dim, size in zip(tensor.shape[1:], value.shape[1:]):
                assert dim in (None, size), tensor.name
            assert tensor.nbytes(batch, sequence_length) == value.nbytes
        assert boundary.nbytes(batch, sequence_length) == sum(
            np.asarray(v).nbytes for v in values.values()
        )
    assert split.bytes_per_cut(batch, sequence_length) == [
        sum(np.asarray(v).nbytes for v in values.values()) for values in sent
    ]
    # The original model still runs as before.
    for a, b in zip(flat_numpy(model(x, training=False)), expected):
        np.testing.assert_array_equal(a, b)

    return max(counts) / max(min(counts), 1)


def assert_best_balance(model, split):
    """The largest stage is as small as any cut among the candidates makes it.

    Cutting at every candidate gives the smallest units a split can have;
    every way of grouping consecutive units into `num_stages` stages is
    tried.
    """
    names = split.candidate_cut_points
    units = split_stages(model, len(names) + 1, cut_points=names)
    sizes = units.parameter_counts
    best = min(
        max(sum(sizes[a:b]) for a, b in zip((0,) + cuts, cuts + (len(sizes),)))
        for cuts in itertools.combinations(
            range(1, len(sizes)), split.num_stages - 1
        )
    )
    assert max(split.parameter_counts) == best


# The project's demo LM -------------------------------------------------


@pytest.fixture(scope="module")
def demo_lm():
    model = transformer_lm(blocks=4)
    x, _ = counting_sequences(4, seq_len=SEQ_LEN)
    return model, x


@pytest.mark.parametrize(
    "num_stages, worst", [(1, 1.0), (2, 1.005), (3, 1.262), (4, 1.352)]
)
def test_demo_lm_cuts_between_blocks_and_balances(demo_lm, num_stages, worst):
    model, x = demo_lm
    split = split_stages(model, num_stages)
    ratio = check_split(model, split, x)
    assert_best_balance(model, split)
    # The max/min stage parameters measured, at the granularity of the
    # candidate cuts (attention or MLP sub-blocks of about 1,100 and 2,100
    # parameters in a 15,392-parameter model).
    assert ratio <= worst
    for boundary in split.boundaries:
        # Only the residual stream crosses: the output of an Add.
        (tensor,) = boundary.tensors
        assert tensor.name.endswith(("_add1", "_add2"))
        assert tensor.shape == (None, SEQ_LEN, 16)
        assert tensor.dtype == "float32" and not tensor.carried
        assert boundary.nbytes(4) == 4 * SEQ_LEN * 16 * 4


def test_demo_lm_training_the_stages_trains_the_model():
    model = transformer_lm(blocks=1)
    x, y = counting_sequences(4, seq_len=SEQ_LEN)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    initial = model.get_weights()
    before = float(loss(y, model(x)))

    split = split_stages(model, 2)
    tokens = keras.Input((SEQ_LEN,), dtype="int32")
    outputs = tokens
    for stage in split.stages:
        outputs = stage.model(outputs)
    chained = keras.Model(tokens, outputs)
    chained.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss)
    chained.train_on_batch(x, y)

    # Every weight of the user's model took the step (all get gradients),
    # and the model computes what the trained stages compute.
    for weight, start in zip(model.get_weights(), initial):
        assert np.abs(weight - start).max() > 0
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(chained(x)))
    assert float(loss(y, model(x))) < before


def test_user_cut_points_start_stages(demo_lm):
    model, x = demo_lm
    split = split_stages(model, 3, cut_points=["block1_ln1", "block3_ln1"])
    check_split(model, split, x)
    assert split.balance is None
    assert split.stages[1].layer_names[0] == "block1_ln1"
    assert split.stages[2].layer_names[0] == "block3_ln1"
    assert split.stages[0].layer_names[-1] == "block0_add2"
    assert split.cut_points == ["block1_ln1", "block3_ln1"]
    # An automatic split's cut points give that split again.
    automatic = split_stages(model, 4)
    again = split_stages(model, 4, cut_points=automatic.cut_points)
    assert [s.operation_names for s in again.stages] == [
        s.operation_names for s in automatic.stages
    ]


def test_summary_lists_stages_and_boundaries(demo_lm):
    model, _ = demo_lm
    text = split_stages(model, 2).summary()
    lines = text.splitlines()
    assert "2 stages" in lines[0] and "15,392" in lines[0]
    assert lines[2].startswith("0 ") and lines[3].startswith("1 ")
    assert "block1_add2 (?, 8, 16) float32" in lines[2]
    assert "512" in lines[2]  # 8 x 16 float32 per sample
    assert "(model outputs)" in lines[3]


# CNNs with residual adds ----------------------------------------------


@functools.lru_cache(maxsize=None)
def small_resnet():
    """Three stages of two residual blocks; some adds are raw `x + y` ops.

    Each stage's first block has a convolution on its shortcut. The shapes
    of the weights are those of the demo LM's (width 16, 64 outputs) or
    few more: on JAX each new shape costs a compilation of its
    initializer.
    """
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3), name="image")
    x = layers.Conv2D(16, 3, padding="same", name="stem_conv")(inputs)
    x = layers.BatchNormalization(name="stem_bn")(x)
    x = layers.ReLU(name="stem_relu")(x)
    for stage in range(3):
        for block in range(2):
            name = f"s{stage}b{block}"
            shortcut = x
            if block == 0:
                shortcut = layers.Conv2D(
                    16, 3, padding="same", name=f"{name}_proj"
                )(x)
            h = layers.Conv2D(16, 3, padding="same", name=f"{name}_conv1")(x)
            h = layers.BatchNormalization(name=f"{name}_bn")(h)
            h = layers.ReLU(name=f"{name}_relu")(h)
            h = layers.Conv2D(16, 3, padding="same", name=f"{name}_conv2")(h)
            if block == 0:
                x = layers.Add(name=f"{name}_add")([shortcut, h])
            else:
                x = shortcut + h  # a raw op: an Operation node in the graph
            x = layers.ReLU(name=f"{name}_out")(x)
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    outputs = layers.Dense(64, name="logits")(x)
    return keras.Model(inputs, outputs, name="small_resnet")


@pytest.mark.parametrize("num_stages", [2, 3])
def test_small_resnet_cuts_at_block_outputs(num_stages):
    model = small_resnet()
    x = np.random.default_rng(0).random((2, 8, 8, 3)).astype("float32")
    split = split_stages(model, num_stages)
    ratio = check_split(model, split, x)
    assert_best_balance(model, split)
    assert ratio <= {2: 1.1, 3: 1.093}[num_stages]
    for boundary in split.boundaries:
        (tensor,) = boundary.tensors  # one block output, no branch
        assert tensor.name.endswith("_out")
    raw_adds = [
        name
        for stage in split.stages
        for name in stage.operation_names
        if name.startswith("add")
    ]
    assert len(raw_adds) == 3  # the raw `shortcut + h` ops are stage nodes


# keras-hub backbones and tasks ----------------------------------------


@functools.lru_cache(maxsize=None)
def gpt2_causal_lm():
    """zoo's GPT2CausalLM: 2 blocks, tied embeddings."""
    model, _, _ = zoo.gpt2()
    return model


def gpt2_backbone():
    return gpt2_causal_lm().backbone


@functools.lru_cache(maxsize=None)
def llama_backbone(num_layers=4):
    keras.utils.set_random_seed(0)
    return keras_hub.models.LlamaBackbone(
        vocabulary_size=zoo.VOCAB,
        num_layers=num_layers,
        num_query_heads=4,
        num_key_value_heads=4,
        hidden_dim=32,
        intermediate_dim=64,
        dropout=0.0,
        dtype=None,
    )


def token_batch():
    x, _ = zoo._lm_data(0)
    return x


@pytest.mark.parametrize(
    "build, num_stages, worst",
    [
        (gpt2_backbone, 2, 1.528),
        (gpt2_backbone, 3, 1.869),
        (llama_backbone, 2, 1.396),
        (llama_backbone, 4, 1.796),
    ],
)
def test_keras_hub_backbones_carry_the_padding_mask(build, num_stages, worst):
    model = build()
    x = token_batch()
    split = split_stages(model, num_stages)
    ratio = check_split(model, split, x, sequence_length=zoo.SEQ_LEN)
    assert_best_balance(model, split)
    # Measured max/min: the embedding (vocabulary 128) joins a block.
    assert ratio <= worst
    hidden = model.hidden_dim
    for boundary in split.boundaries:
        # The residual stream, plus the padding mask every block reads.
        assert len(boundary.tensors) == 2
        mask = boundary.tensors[0]
        assert mask.name == "padding_mask" and mask.carried
        assert mask.dtype == "int32" and mask.shape == (None, None)
        stream = boundary.tensors[1]
        assert stream.shape == (None, None, hidden) and not stream.carried
        with pytest.raises(ValueError, match="sequence_length"):
            boundary.nbytes(4)
        assert boundary.nbytes(4, zoo.SEQ_LEN) == (
            4 * zoo.SEQ_LEN * 4 + 4 * zoo.SEQ_LEN * hidden * 4
        )
    assert "padding_mask*" in split.summary()
    assert "132·L" in split.summary()  # (1 + 32) x 4 bytes per position


@pytest.fixture(scope="module")
def bert_classifier():
    model, x, _ = zoo.bert()
    return model, x


def test_nested_backbone_is_opened(bert_classifier):
    model, x = bert_classifier
    split = split_stages(model, 3)
    check_split(model, split, x, sequence_length=zoo.SEQ_LEN)
    # The backbone is not one layer: its blocks go to different stages,
    # and the classifier head joins the last one.
    names = [s.layer_names for s in split.stages]
    assert "transformer_layer_0" in names[1]
    assert "transformer_layer_1" in names[2] and "logits" in names[2]
    # Keras numbers the names of models built earlier in the process.
    prefix = f"{model.backbone.name}."
    assert all(n.startswith(prefix) for n in split.cut_points)
    for boundary in split.boundaries:
        assert boundary.names[0] == "padding_mask"
    # A layer inside the backbone can be named with or without its prefix.
    named = split_stages(model, 2, cut_points=["transformer_layer_1"])
    check_split(model, named, x, sequence_length=zoo.SEQ_LEN)
    assert named.cut_points == [f"{prefix}transformer_layer_1"]


def test_backbone_with_dict_outputs(bert_classifier):
    model, x = bert_classifier
    backbone = model.backbone
    split = split_stages(backbone, 2)
    check_split(backbone, split, x, sequence_length=zoo.SEQ_LEN)
    last = split.stages[-1].model(split.stages[0].model(x))
    assert sorted(last) == ["pooled_output", "sequence_output"]


def test_a_tied_embedding_can_be_shared_by_the_stages_that_call_it():
    model = gpt2_causal_lm()
    x = token_batch()
    split = split_stages(model, 2)
    (path,) = split.shared_weights
    assert "token_embedding" in path
    assert split.shared_weights[path] == [0, 1]
    assert f"weight {path} is used by stages [0, 1]" in split.summary()
    # One stage holds both calls.
    assert split_stages(model, 1).shared_weights == {}
    # Both stage models call the one layer: the same variable.
    first, last = (
        [v for v in stage.model.weights if v.path == path]
        for stage in split.stages
    )
    assert first[0] is last[0]
    for got, want in zip(
        flat_numpy(split.run(x)), flat_numpy(model(x, training=False))
    ):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


# Other graphs ---------------------------------------------------------


def long_skip_model():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((12,), name="features")
    stem = layers.Dense(16, name="stem")(inputs)
    x = stem
    for i in range(4):
        x = layers.Dense(16, activation="relu", name=f"dense_{i}")(x)
    x = layers.Concatenate(name="merge")([x, stem])
    outputs = layers.Dense(3, name="head")(x)
    return keras.Model(inputs, outputs, name="long_skip")


def test_a_long_skip_is_carried_across_stages():
    model = long_skip_model()
    x = np.random.default_rng(0).normal(size=(3, 12)).astype("float32")
    split = split_stages(model, 3, cut_points=["dense_1", "dense_3"])
    check_split(model, split, x)
    first, second = split.boundaries
    assert first.names == ["stem", "dense_0"]
    assert [t.carried for t in first.tensors] == [False, False]
    assert second.names == ["stem", "dense_2"]
    assert [t.carried for t in second.tensors] == [True, False]
    assert split.stages[1].input_names == ["stem", "dense_0"]
    assert split.stages[1].output_names == ["stem", "dense_2"]
    assert split.bytes_per_cut(5) == [5 * 32 * 4, 5 * 32 * 4]
    # Automatically, only cuts where one activation crosses qualify: after
    # the stem and after the merge.
    assert split_stages(model, 3).cut_points == ["dense_0", "head"]
    with pytest.raises(ValueError, match="2 candidate cut point"):
        split_stages(model, 4)


# Stage 0's eager outputs keep the mask Keras attached; stage 1 receives the
# mask as a tensor of its own, and Keras warns that the attached one is
# dropped.
@pytest.mark.filterwarnings("ignore:.*does not support masking")
def test_keras_masks_cross_as_tensors():
    keras.utils.set_random_seed(0)
    tokens = keras.Input((6,), dtype="int32", name="tokens")
    h = layers.Embedding(20, 8, mask_zero=True, name="embed")(tokens)
    h = layers.Dense(8, name="proj")(h)
    h = layers.GlobalAveragePooling1D(name="masked_mean")(h)
    model = keras.Model(tokens, layers.Dense(2, name="out")(h))
    x = np.array([[3, 4, 5, 0, 0, 0], [1, 2, 3, 4, 5, 6]], "int32")
    split = split_stages(model, 2, cut_points=["masked_mean"])
    check_split(model, split, x)
    dtypes = {t.name: t.dtype for t in split.boundaries[0].tensors}
    assert "bool" in dtypes.values()  # the padding mask Embedding made
    # The mask matters: a mean over the padding too differs.
    projected = np.asarray(split.stages[0].model(x)["proj"])
    unmasked = model.get_layer("out")(projected.mean(axis=1))
    assert np.abs(np.asarray(unmasked) - np.asarray(model(x))).max() > 1e-3


def test_sequential_model():
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((6,))]
        + [layers.Dense(6, activation="tanh", name=f"d{i}") for i in range(6)]
    )
    x = np.random.default_rng(0).normal(size=(2, 6)).astype("float32")
    split = split_stages(model, 3)
    assert check_split(model, split, x) == 1.0
    assert [s.layer_names for s in split.stages] == [
        ["d0", "d1"],
        ["d2", "d3"],
        ["d4", "d5"],
    ]


# Refusals ---------------------------------------------------------------


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.dense = layers.Dense(4)

    def call(self, x):
        return self.dense(x)


def test_balance_by_measured_time():
    """Four equal convolutions hold few parameters and all the compute; a
    wide Dense after them holds most parameters and little compute.
    Balanced by parameters, the cut falls before the Dense; balanced by
    the blocks' measured times, between the convolutions."""
    inputs = keras.Input((48, 48, 24))
    x = inputs
    for i in range(4):
        x = layers.Conv2D(24, 3, padding="same", name=f"conv_{i}")(x)
    x = layers.GlobalAveragePooling2D(name="pool")(x)
    model = keras.Model(inputs, layers.Dense(8192, name="wide")(x))
    rng = np.random.default_rng(0)
    sample = rng.normal(size=(8, 48, 48, 24)).astype("float32")
    by_parameters = split_stages(model, 2)
    assert by_parameters.cut_points == ["wide"]
    by_time = split_stages(model, 2, balance="time", sample=sample)
    # Two convolutions a stage, measured; a loaded machine may time them
    # unevenly, but never make the Dense the heavier half.
    assert by_time.cut_points[0] in ("conv_1", "conv_2", "conv_3")
    assert by_time.balance == "time"
    np.testing.assert_allclose(
        by_time.run(sample), model(sample), rtol=1e-5, atol=1e-5
    )


def test_subclassed_model_is_refused():
    model = Subclassed()
    model(np.ones((1, 3), "float32"))
    with pytest.raises(NotImplementedError, match="subclassed.*Functional"):
        split_stages(model, 2)


def test_bad_arguments_are_refused(demo_lm):
    model, _ = demo_lm
    with pytest.raises(ValueError, match="num_stages must be an integer >= 1"):
        split_stages(model, 0)
    with pytest.raises(ValueError, match="num_stages must be an integer"):
        split_stages(model, "2")
    with pytest.raises(ValueError, match="Unknown balance 'flops'"):
        split_stages(model, 2, balance="flops")
    with pytest.raises(ValueError, match="pass sample=x with it"):
        split_stages(model, 2, balance="time")
    candidates = split_stages(model, 2).candidate_cut_points
    # After the token embedding, the embedding add, each residual add and
    # the final LayerNormalization.
    assert len(candidates) == 2 + 2 * 4 + 1
    with pytest.raises(ValueError, match="at most 12 stages; got num_st"):
        split_stages(model, 13)
    with pytest.raises(
        ValueError, match="no layer named 'block1_lnl'.*block1_ln1"
    ):
        split_stages(model, 2, cut_points=["block1_lnl"])
    with pytest.raises(ValueError, match="'block1_ln1'.*does not come after"):
        split_stages(model, 3, cut_points=["block2_ln1", "block1_ln1"])
    with pytest.raises(ValueError, match="needs 2 cut point"):
        split_stages(model, 3, cut_points=["block2_ln1"])
    with pytest.raises(ValueError, match="stage 0 would be empty"):
        split_stages(model, 2, cut_points=["token_embedding"])
    with pytest.raises(TypeError, match="list of layer names"):
        split_stages(model, 2, cut_points="block2_ln1")


def test_the_stages_add_the_losses_their_layers_add():
    # Weight and activity regularizers and an add_loss layer, on both sides
    # of the cut: the stages' losses add up to the model's.
    model = pipeline_cases.regularized_mlp()
    x = np.random.default_rng(0).normal(size=(4, 6)).astype("float32")
    model(x)
    expected = sum(float(loss) for loss in model.losses)
    split = split_stages(model, 2)
    split.run(x)
    stages = [stage.model.losses for stage in split.stages]
    assert all(stages)
    got = sum(float(loss) for losses in stages for loss in losses)
    assert abs(got - expected) < 1e-6 * abs(expected), (got, expected)
