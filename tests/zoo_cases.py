"""The model zoo checks, shared by the JAX, torch and TensorFlow tests.

Each check builds a zoo model twice with the same seed, splits one copy
with `TensorParallelKeras` and keeps the other on one device as the
oracle, and returns plain numbers (so a torch rank can hand them back):

- `forward`: largest output difference on the zoo batch;
- `weights`: largest weight difference after 2 SGD steps;
- `bytes_ratio`: the largest per-device parameter bytes, measured from
  the arrays, over the ideal total / N;
- `collectives`: the training step's collectives by kind and direction;
- `plan`: `{layer path: style}` and `replicated`: `{layer path: reason}`.
"""

import keras
import keras_hub
import numpy as np

import keras_tp
from tests import models
from tests import zoo

_ROW = keras_tp.Row()
_COLUMN = keras_tp.Column()

TRANSFORMERS = (
    "gemma",
    "gemma_lora",
    "gpt2",
    "llama",
    "mistral",
    "qwen3",
    "gemma4",
    "phi3",
    "mixtral",
    "distilbert",
    "roberta",
    "bert",
    "vit",
    "bart",
    "t5",
    "clip",
)
# Decoder-only LMs of the zoo: 2 blocks, token embedding and LM head in one
# ReversibleEmbedding (tied or not).
DECODER_LMS = ("gemma", "gpt2", "llama", "mistral", "qwen3", "gemma4", "phi3")
# The whole layers of each of these LMs' blocks that compute on a rank's
# heads: Gemma's single key/value head (key and value), Qwen3's and Gemma
# 4's per-head query and key norms. The ranks sum their gradients, one
# all-reduce each, on every backend: on JAX's global arrays the per-head
# norms run on each device's heads (`partial_gradients`), and a model
# with whole key/value heads runs its steps per rank
# (`ShardingPlan.summed_by_xla`), where XLA summed their gradients in
# collectives of its own before.
SUMMED_PER_BLOCK = {"gemma": 2, "qwen3": 2, "gemma4": 2}
BLOCKS = 2
# A keras-hub CausalLM compiles itself with an accuracy metric. From split
# logits the loss all-reduces one float per token twice (the maximum, then
# the sums of exponentials with the target's logit), and the accuracy twice
# (the maximum, then the first index that holds it).
LOSS_AND_ACCURACY_REDUCTIONS = 4


def check_megatron(results, summed_weights=0):
    """A decoder LM's training step costs Megatron's minimum on `model`.

    Forward: one all-reduce per attention and per MLP (their Row layers)
    and one for the vocabulary-parallel embedding; then, where the logits
    stay split by vocabulary, `LOSS_AND_ACCURACY_REDUCTIONS`, else one
    all-gather of the logits. Backward: one all-reduce
    per attention and per MLP input (their Column layers share it), one
    for the LM head's input, and one for each of `summed_weights` whole
    layers computing on a rank's heads (a per-head norm, key/value heads
    fewer than ranks), where ranks hold their own slices.
    """
    rows = [s for s in results["plan"].values() if s == repr(_ROW)]
    assert len(rows) == 2 * BLOCKS, results["plan"]
    collectives = results["collectives"]
    split = results["logits_split"]
    assert collectives["all_reduce"] == {
        "forward": 2 * BLOCKS
        + 1
        + (LOSS_AND_ACCURACY_REDUCTIONS if split else 0),
        "backward": 2 * BLOCKS + 1 + summed_weights,
    }, collectives
    gathers = {"forward": 0 if split else 1, "backward": 0}
    assert collectives.get("all_gather", gathers) == gathers, collectives


def check_exact(results, tolerance=1e-5):
    assert results["forward"] <= tolerance, results
    assert results["weights"] <= tolerance, results


# Per MoE family of the zoo, its layers under 1% of the parameter bytes
# that no Megatron pair splits: each block's router (Mixtral's, and
# Qwen-MoE's, which keras-hub's layout map lists) and Qwen-MoE's shared
# expert gate.
SMALL_WHOLE = {"mixtral": 2, "qwen_moe": 4}


def check_small_layers_whole(name, results):
    """The MoE family `name`'s routers and gates stay whole, as
    Megatron keeps them, with the reason: split alone, each would cost a
    collective at every call."""
    small = [
        path
        for path, reason in results["replicated"].items()
        if reason.startswith("kept whole: ")
        and "of the model's parameter bytes" in reason
    ]
    assert len(small) == SMALL_WHOLE[name], results["replicated"]
    assert all("gate" in path or "router" in path for path in small), small


def check_block_by_block_gathers(results):
    """Qwen3.5 (`zoo.qwen3_5`), on every backend.

    Its linear attention projects queries, keys and values block by
    block: the first rank's contiguous part of the fused projection
    reaches every head of the output projection's input
    (`plan/dependence.py`), so the projections are no Megatron pair. The
    three large ones gather their outputs, one all-gather each; the two
    small gates stay whole; the full attention and the MLPs pair as
    Megatron's. No layer falls back: the plan is right before the check.
    """
    check_exact(results)
    assert not results["fallbacks"], results["fallbacks"]
    linear = "transformer_layer_0/linear_attn/"
    gathering = repr(keras_tp.Column(gather_output=True))
    for name in ("in_proj_qkv", "in_proj_z", "out_proj"):
        assert results["plan"][linear + name] == gathering, results["plan"]
    for name in ("in_proj_a", "in_proj_b"):
        assert "kept whole" in results["replicated"][linear + name]
    assert results["collectives"]["all_gather"]["forward"] == 3
    rows = [s for s in results["plan"].values() if s == repr(_ROW)]
    assert len(rows) == 3  # the full attention's and the two MLPs'
    assert results["bytes_ratio"] <= 1.03


def _two_sgd_steps(model, name, x, y):
    model.compile(optimizer=keras.optimizers.SGD(1e-2), loss=zoo.loss_for(name))
    for _ in range(2):
        model.train_on_batch(x, y)


# The one-device oracle of each zoo model, by name and dtype policy: `(its
# output on the zoo batch before training, the model after
# `_two_sgd_steps`)`. A process compares several layouts of a model with
# the same oracle (Llama with and without sequence parallelism, at each
# ZeRO stage; a zoo model at 2 and 4 ranks): it trains once. Callers only
# read it.
_oracles = {}


def _oracle(name, reference, x, y):
    """`_oracles[name]` (under the dtype policy set), made from the fresh
    `reference` if not yet."""
    key = name, keras.config.dtype_policy().name
    if key not in _oracles:
        output = keras.tree.map_structure(_float64, reference(x))
        _two_sgd_steps(reference, name, x, y)
        _oracles[key] = output, reference
    return _oracles[key]


def trained(name, world_size, **wrap_kwargs):
    """`(one-device model, split copy)` of zoo model `name` after 2 SGD
    steps (the split copy's collectives are those of its last step)."""
    reference, tp, x, y = pair(name, world_size, **wrap_kwargs)
    _, reference = _oracle(name, reference, x, y)
    _two_sgd_steps(tp, name, x, y)
    return reference, tp


def sequence_parallel_results(name, world_size, **wrap_kwargs):
    """What `check_sequence_parallel` checks of decoder LM `name`: its
    weights after 2 SGD steps with `sequence_parallel=True` next to one
    device's, and the `model`-axis collectives of its last step with and
    without sequence parallelism (both wrapped with `wrap_kwargs`)."""
    reference, tp = trained(
        name, world_size, sequence_parallel=True, **wrap_kwargs
    )
    _, plain = trained(name, world_size, **wrap_kwargs)
    return {
        "weights": _largest(tp.get_weights(), reference.get_weights()),
        "sequence": tp.communication_stats(axis="model"),
        "plain": plain.communication_stats(axis="model"),
        "logits_split": _logits_split(tp),
        "whole_weights": sum(
            tp._runtime.placement.split_axis(v) is None
            for v in tp.trainable_variables
        ),
        "summed_without_sequence": _summed_only_in(plain, tp),
    }


def _summed_only_in(model, other):
    """Bytes of the gradients `model`'s ranks sum of the weights of its
    whole layers that `other` does not sum (on JAX, Gemma's key/value head
    summed per rank, which under sequence parallelism XLA sums itself)."""
    summed = set(other.sharding_plan.summed_gradients)
    return sum(
        int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
        for layer in model.sharding_plan.summed_gradients
        if layer not in summed
        for v in layer.trainable_weights
    )


def check_sequence_parallel(results, whole_weight_reductions, regathered):
    """Megatron's sequence parallelism: exact, and per block 2 all-gathers
    and 2 reduce-scatters each way in place of the 2 all-reduces, with the
    same bytes.

    Per block, the attention's and the MLP's input are all-gathered from
    their sequence shards and their Row outputs reduce-scattered; the
    embedding's lookup is reduce-scattered, the LM head's input gathered,
    and its logits gathered over the vocabulary unless they stay split for
    the loss (whose all-reduces both runs make alike). Each backward pass
    is the other collective.

    Args:
        results: `sequence_parallel_results`.
        whole_weight_reductions: the backward all-reduces expected of the
            weights that stay whole (each computed on a sequence shard):
            one per weight where the backend counts them, else 0.
        regathered: whether the backward pass gathers each gathered shard
            again, as Megatron does, instead of keeping it whole (torch);
            on JAX, XLA's choice is not counted.
    """
    assert results["weights"] < 1e-5, results["weights"]
    stats, plain = results["sequence"], results["plain"]
    # What the step issues alike without sequence parallelism (TensorFlow's
    # broadcast of the replicated weights' gradients) is not its own.
    calls = {
        kind: (entry["forward_calls"], entry["backward_calls"])
        for kind, entry in stats.items()
        if plain.get(kind) != entry
    }
    gathers = 2 * BLOCKS + 1
    split = results["logits_split"]
    loss_reductions = LOSS_AND_ACCURACY_REDUCTIONS if split else 0
    logits_gathers = 0 if split else 1
    expected = {
        "reduce_scatter": (gathers, gathers),
        "all_gather": (
            gathers + logits_gathers,
            gathers * (2 if regathered else 1),
        ),
    }
    if whole_weight_reductions or loss_reductions:
        expected["all_reduce"] = (loss_reductions, whole_weight_reductions)
    assert calls == expected, calls

    def sent(entries, kind, direction):
        return entries.get(kind, {}).get(f"{direction}_bytes", 0)

    # The loss's and accuracy's all-reduces are the same in both runs.
    loss_bytes = sent(stats, "all_reduce", "forward")

    def reduced(direction):
        plain_bytes = sent(plain, "all_reduce", direction)
        if direction == "forward":
            return plain_bytes - loss_bytes
        return plain_bytes - results["summed_without_sequence"]

    # An all-reduce is a reduce-scatter and an all-gather of its buffer.
    for direction in ("forward", "backward"):
        assert sent(stats, "reduce_scatter", direction) == reduced(direction)

    def gathered(direction):
        return sent(stats, "all_gather", direction) - sent(
            plain, "all_gather", direction
        )

    assert gathered("forward") == reduced("backward")
    again = gathered("forward") if regathered else 0
    assert gathered("backward") == reduced("forward") + again


def dropout_difference(world_size):
    """Largest weight difference between a GPT2 backbone with dropout
    trained 2 steps split with and without sequence parallelism."""
    x, y = models.backbone_data(4, length=8)
    weights = []
    for sequence in (False, True):
        keras.utils.set_random_seed(3)
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=64,
            num_layers=2,
            num_heads=2,
            hidden_dim=16,
            intermediate_dim=32,
            max_sequence_length=8,
            dropout=0.3,
        )
        tp = keras_tp.TensorParallelKeras(
            backbone, world_size=world_size, sequence_parallel=sequence
        )
        tp.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        for _ in range(2):
            tp.train_on_batch(x, y)
        weights.append(tp.get_weights())
    return models.max_diff(*weights)


def pair(name, world_size, **wrap_kwargs):
    """`(one-device model, split copy, x, y)` of zoo model `name`."""
    reference, x, y = zoo.ZOO[name]()
    tp = keras_tp.TensorParallelKeras(
        zoo.ZOO[name]()[0], world_size=world_size, **wrap_kwargs
    )
    return reference, tp, x, y


def measure(name, world_size, **wrap_kwargs):
    """Runs the zoo checks of model `name` split `world_size` ways."""
    return measured(name, world_size, **wrap_kwargs)[0]


def measured(name, world_size, **wrap_kwargs):
    """`(measure's results, the split model it trained, x, y)`."""
    reference, tp, x, y = pair(name, world_size, **wrap_kwargs)
    output, reference = _oracle(name, reference, x, y)
    results = {"forward": _largest(tp(x), output)}
    _two_sgd_steps(tp, name, x, y)
    results["weights"] = _largest(tp.get_weights(), reference.get_weights())
    stats = tp.communication_stats("train", axis="model")
    results["collectives"] = {
        kind: {
            "forward": entry["forward_calls"],
            "backward": entry["backward_calls"],
        }
        for kind, entry in stats.items()
    }
    info = tp.get_parallelism_info()
    per_device = info["parameter_bytes_per_device"].values()
    ideal = info["parameter_bytes_total"] / world_size
    results["bytes_ratio"] = max(per_device) / ideal
    results["plan"] = {
        entry.layer.path: repr(entry.style)
        for entry in tp.sharding_plan.leaf_layers()
    }
    results["replicated"] = dict(tp.sharding_plan.replicated)
    results["fallbacks"] = dict(tp.sharding_plan.fallbacks)
    results["logits_split"] = _logits_split(tp)
    return results, tp, x, y


def _logits_split(tp):
    """Whether `tp` keeps its LM head's logits split in training."""
    return tp.get_parallelism_info()["vocab_parallel_head"] is not None


def _largest(a, b):
    a = keras.tree.flatten(a)
    b = keras.tree.flatten(b)
    return max(
        float(np.max(np.abs(_float64(x) - _float64(y)))) for x, y in zip(a, b)
    )


def _float64(x):
    return np.asarray(keras.ops.convert_to_numpy(x)).astype("float64")


def mixed_precision(name, world_size, policy="mixed_bfloat16"):
    """Forward and 2-SGD-step differences under a mixed dtype policy.

    Both models are built under `policy`; the forward difference is
    relative to the largest output. Returns `(forward, weights)`.
    """
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        reference, tp, x, y = pair(name, world_size)
        out = keras.ops.convert_to_numpy(keras.ops.cast(tp(x), "float32"))
        expected = keras.ops.convert_to_numpy(
            keras.ops.cast(reference(x), "float32")
        )
        forward = float(np.max(np.abs(out - expected))) / float(
            np.max(np.abs(expected))
        )
        for model in (reference, tp):
            model.compile(
                optimizer=keras.optimizers.SGD(1e-2),
                loss=zoo.loss_for(name),
            )
            for _ in range(2):
                model.train_on_batch(x, y)
        weights = _largest(tp.get_weights(), reference.get_weights())
    finally:
        keras.config.set_dtype_policy(previous)
    return forward, weights


def check_mixed_precision(forward, weights):
    # bfloat16 keeps 8 bits of mantissa (float16 11): a split sums its
    # partial products in another order, so outputs agree to that
    # rounding, and the float32 master weights after 2 steps to about
    # 1e-4.
    assert forward <= 1e-2, forward
    assert weights <= 1e-4, weights


def forward_difference(name, world_size):
    """Largest output difference of a zoo model split `world_size` ways."""
    reference, tp, x, _ = pair(name, world_size)
    return _largest(tp(x), reference(x))


CNNS = ("resnet50", "efficientnetb0")


def cnn_checks(name, world_size):
    """Forward difference and plan of a `keras.applications` CNN.

    Training is not compared: at the zoo's size (32x32 images, batch 4)
    BatchNormalization in training mode normalises the last stage over 4
    nearly equal values, and the one-device model disagrees with itself
    (compiled against eager) after one SGD step by more than the split
    does. The Conv -> BatchNormalization -> Conv training path is checked
    exactly on `tests/models.py`'s `cnn`.
    """
    reference, tp, x, _ = pair(name, world_size)
    styles = [repr(e.style) for e in tp.sharding_plan.leaf_layers()]
    return {
        "forward": _largest(tp(x), reference(x)),
        "channelwise": styles.count(repr(keras_tp.Channelwise())),
        "pairs": styles.count(repr(_ROW)),
        "plan": {
            entry.layer.path: repr(entry.style)
            for entry in tp.sharding_plan.leaf_layers()
        },
        "fallbacks": dict(tp.sharding_plan.fallbacks),
    }


def check_resnet(results):
    """Every bottleneck pairs two convolutions through its BN.

    ResNet50 has 16 bottleneck blocks: 1x1 conv (Column) -> BatchNorm
    (Channelwise, statistics local to the rank's channels) -> ReLU -> 3x3
    conv (Row). The stem's 7x7 convolution is a Column too: through its
    BatchNorm and the max pooling it reaches the first block's two 1x1
    convolutions (its main path's and its shortcut's), its Rows; that
    block pairs its 3x3 convolution (Column) with its last 1x1 (Row).
    """
    assert results["forward"] <= 1e-5, results
    assert results["channelwise"] == 17, results
    assert results["pairs"] == 18, results
    plan = results["plan"]
    assert plan["conv1_conv"] == plan["conv2_block1_2_conv"] == repr(_COLUMN)
    for name in ("conv2_block1_0_conv", "conv2_block1_1_conv"):
        assert plan[name] == repr(_ROW), (name, plan)
    assert not results["fallbacks"], results["fallbacks"]


def check_separable(results):
    """Xception's block pairs its separable convolutions through its BN.

    The first SeparableConv2D splits its pointwise filters (Column; its
    depthwise kernel stays whole), its BatchNormalization its channels
    (Channelwise), and the second SeparableConv2D its input channels
    (Row), in both kernels, with the grouped convolution between them
    split by groups (Channelwise). Inception's 1x1 convolution is a Column
    read by two Rows, the 1x3 and the 3x1 convolution. MobileNetV2's expansion
    and projection pair through the depthwise convolution and the
    BatchNormalizations, each split by channels, and through the
    squeeze-and-excitation gate: its first convolution is another Row of
    the expansion (reading the pooled split channels through a reshape),
    its second a Column of the group whose split gate multiplies the split
    channels. Training matches one device, and the kernels are split in
    memory.
    """
    check_exact(results)
    plan = results["plan"]
    column = repr(keras_tp.Column(gather_output=False))
    row = repr(keras_tp.Row(input_is_parallel=True))
    channelwise = repr(keras_tp.Channelwise())
    assert plan["sepconv1"] == plan["branch"] == plan["expand"] == column
    assert plan["sepconv2"] == plan["branch_1x3"] == plan["branch_3x1"] == row
    assert plan["project"] == plan["se_reduce"] == row, plan
    assert plan["se_expand"] == column, plan
    split = ("sepconv1_bn", "grouped", "expand_bn", "depthwise", "depthwise_bn")
    for name in split:
        assert plan[name] == channelwise, (name, plan)
    assert not results["fallbacks"], results["fallbacks"]


def refused_split_of_held_weights(name, world_size):
    """The error of wrapping zoo model `name` with a plan that splits every
    layer the planner would without the runtime's knowledge of weights a
    graph constant reads (`auto_plan` without `keep_whole`)."""
    model = zoo.ZOO[name]()[0]
    plan = keras_tp.auto_plan(model, world_size, check_local=False)
    try:
        keras_tp.TensorParallelKeras(model, world_size=world_size, plan=plan)
    except keras_tp.ShardingError as error:
        return str(error)
    return None
