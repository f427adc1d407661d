"""keras-hub models split on torch: 2 processes over gloo.

Run with `KERAS_BACKEND=torch python -m pytest tests/test_torch_zoo.py`.
One launch runs every model (starting processes is the slow part); each
rank builds its one-device oracle with the same seed. The checks are
shared with JAX and TensorFlow in `tests/zoo_cases.py`.
"""

import keras
import pytest

if keras.backend.backend() != "torch":
    pytest.skip(
        "torch backend tests; run with KERAS_BACKEND=torch",
        allow_module_level=True,
    )

from keras_tp.launcher import launch  # noqa: E402
from tests import blocked_cases  # noqa: E402
from tests import zoo_cases  # noqa: E402
from tests.torch_scripts import blocked_checks  # noqa: E402
from tests.torch_scripts import zoo_checks  # noqa: E402

# T5Gemma's attention returns its key/value cache in training too: on a
# rank that holds its own slices, the cache of its heads. GPT-OSS's
# attention holds a weight of its own per head (its sinks), and
# RoFormer-v2's projects with Dense layers, heads folded into features.
# Falcon's and GPT-NeoX's flatten their heads into features, and Falcon's
# takes an ALiBi bias for every head from its decoder block; Bloom's
# `AlibiBias` reads the heads count from its scores' shape. QwenMoE scales
# its shared expert's output in place after the call. Gemma3n's graph holds
# a view of its token embedding, taken when it was built. Qwen3.5's linear
# attention projects its queries, keys and values block by block.
NAMES = list(zoo_cases.TRANSFORMERS) + [
    "t5gemma",
    "gpt_oss",
    "roformer_v2",
    "falcon",
    "bloom",
    "gpt_neox",
    "qwen_moe",
    "gemma3n",
    "xlnet",
    "qwen3_5",
]
WORLD_SIZE = 2


@pytest.fixture(scope="module")
def ranks():
    return launch(
        zoo_checks.zoo_checks,
        world_size=WORLD_SIZE,
        args=(NAMES, WORLD_SIZE),
        timeout=900,
    )


@pytest.mark.parametrize("name", NAMES)
def test_exact_on_every_rank(ranks, name):
    for rank in ranks:
        zoo_cases.check_exact(rank[name])


def test_megatron_pairs_where_each_rank_runs_its_slices(ranks):
    results = ranks[0]
    # Llama's attention and MLP run on a rank's heads and features as
    # they are. Gemma's attention reshapes to its config's head counts,
    # which each rank reads as its own; its single key/value head stays
    # whole, and Qwen3 and Gemma 4 normalise each head with whole weights:
    # the ranks sum those weights' gradients. Gemma 4's MLP multiplies by
    # its projections' kernels itself: they run as calls of the
    # projections. Falcon's and GPT-NeoX's attention read their head
    # counts and their heads' slice of Falcon's ALiBi bias; Bloom's
    # `AlibiBias` runs on all heads, the rank's in place. Every block
    # pairs.
    for name in (*zoo_cases.DECODER_LMS, "falcon", "bloom", "gpt_neox"):
        assert not results[name]["fallbacks"], results[name]["fallbacks"]
        zoo_cases.check_megatron(
            results[name],
            zoo_cases.BLOCKS * zoo_cases.SUMMED_PER_BLOCK.get(name, 0),
        )


def test_a_fused_projection_laid_out_block_by_block_gathers(ranks):
    zoo_cases.check_block_by_block_gathers(ranks[0]["qwen3_5"])


def test_attention_returning_its_split_cache_pairs(ranks):
    results = ranks[0]["t5gemma"]
    assert not results["fallbacks"], results["fallbacks"]
    assert results["bytes_ratio"] <= 1.05, results["bytes_ratio"]


def test_attention_with_a_weight_per_head_pairs(ranks):
    # Each rank reads its heads' sinks; their gradient is gathered whole
    # from the ranks' slices, one all-gather per block.
    results = ranks[0]["gpt_oss"]
    assert not results["fallbacks"], results["fallbacks"]
    assert results["bytes_ratio"] <= 1.05, results["bytes_ratio"]
    gathers = results["collectives"]["all_gather"]["backward"]
    assert gathers == zoo_cases.BLOCKS, results["collectives"]


def test_an_attention_given_per_head_weights_splits_by_heads(ranks):
    # XLNet (see test_jax.py): each rank takes its heads' slice of the 4
    # per-head weights its block hands to the attention; their gradients
    # are gathered whole, one all-gather each per block. The classifier,
    # under 1% of the parameter bytes, stays whole (split alone it would
    # slice its input and gather that input's gradient).
    results = ranks[0]["xlnet"]
    assert not results["fallbacks"], results["fallbacks"]
    assert results["bytes_ratio"] <= 1.05, results["bytes_ratio"]
    gathers = results["collectives"]["all_gather"]["backward"]
    assert gathers == 4 * zoo_cases.BLOCKS, results["collectives"]
    assert results["replicated"]["classifier"].startswith("kept whole: "), (
        results["replicated"]
    )


def test_attention_reshaping_dense_projections_pairs(ranks):
    # RoFormer-v2 reshapes its Dense projections to its `heads`, which a
    # rank reads as its own count: every block's attention and MLP pair,
    # and so does the classifier's head; one all-reduce backward each.
    results = ranks[0]["roformer_v2"]
    assert not results["fallbacks"], results["fallbacks"]
    assert results["bytes_ratio"] <= 1.05, results["bytes_ratio"]
    rows = [s for s in results["plan"].values() if s.startswith("Row")]
    pairs = 2 * zoo_cases.BLOCKS + 1
    assert len(rows) == pairs, results["plan"]
    backward = results["collectives"]["all_reduce"]["backward"]
    assert backward == pairs, results["collectives"]


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_mixed_precision_trains_at_parity(ranks, policy):
    # mixed_float16 scales the loss: every rank checks the gradients of
    # all of them for overflow (a GlobalLossScaleOptimizer).
    for rank in ranks:
        zoo_cases.check_mixed_precision(*rank[policy])


def test_separable_convolutions_pair_through_batchnorm(ranks):
    for rank in ranks:
        zoo_cases.check_separable(rank["separable_cnn"])


def test_cnns_forward_exact_and_batchnorm_local(ranks):
    for rank in ranks:
        zoo_cases.check_resnet(rank["cnns"]["resnet50"])
        assert rank["cnns"]["efficientnetb0"]["forward"] <= 1e-5


@pytest.mark.parametrize("name", ["mixtral", "qwen_moe"])
def test_experts_split_where_each_rank_runs_its_slices(ranks, name):
    # QwenMoE's block multiplies its shared expert's output by a gate in
    # place: the planner judges each call on the values it returned.
    results = ranks[0][name]
    experts = [p for p, s in results["plan"].items() if "ExpertParallel" in s]
    assert len(experts) == 2, results["plan"]
    assert not results["fallbacks"], results["fallbacks"]
    assert results["bytes_ratio"] <= 1.05, results["bytes_ratio"]
    zoo_cases.check_small_layers_whole(name, results)


def test_weights_a_graph_constant_views_stay_whole(ranks):
    # Gemma3n's graph computes its logits from the transpose of its token
    # embedding, a view taken when the model was built, which a split
    # would leave on the whole storage: the embedding stays whole, and a
    # plan that splits it is refused.
    results = ranks[0]["gemma3n"]
    # Its attention holds 4 heads of 8 beside other attributes of 8: read
    # as the heads count, the larger head size splits it by heads.
    attention = [p for p in results["fallbacks"] if "/attention/" in p]
    assert not attention, attention
    reason = results["fallbacks"]["text_model/embed_tokens/embedding"]
    assert "an argument of 'matmul" in reason, reason
    # Each block's per-layer input, multiplied whole into its gate's
    # split output, is sliced per rank (`plan/feature_arguments.py`):
    # the embedding is all that stays whole.
    assert list(results["fallbacks"]) == ["text_model/embed_tokens/embedding"]
    refusal = ranks[0]["held_refusal"]
    assert refusal and "text_model/embed_tokens/embedding/embeddings" in refusal


@pytest.fixture(scope="module")
def blocked(tmp_path_factory):
    return launch(
        blocked_checks.blocked_checks,
        world_size=WORLD_SIZE,
        args=(WORLD_SIZE, str(tmp_path_factory.mktemp("blocked"))),
        timeout=600,
    )


def test_fused_projections_split_by_blocks(blocked):
    for rank in blocked:
        blocked_cases.check_blocked(rank)


def test_lora_factors_split_by_blocks(blocked):
    for rank in blocked:
        zoo_cases.check_exact(rank["lora"])
        plan = rank["lora"]["plan"]
        assert plan["block_0/qkv"] == "Column(gather_output=False, blocks=3)"


def test_swin_attention_pairs_by_blocks(blocked):
    for rank in blocked:
        blocked_cases.check_swin(rank["swin"])
