"""keras-hub and keras.applications models split on JAX (4 devices).

Run with `KERAS_BACKEND=jax python -m pytest tests/test_jax_zoo.py`. The
models come from `tests/zoo.py` (tiny configs, random weights, offline);
the checks are shared with torch and TensorFlow in `tests/zoo_cases.py`.
"""

import logging

import jax
import keras
import numpy as np
import pytest

if keras.backend.backend() != "jax":
    pytest.skip(
        "JAX backend tests; run with KERAS_BACKEND=jax",
        allow_module_level=True,
    )

import keras_tp  # noqa: E402
from keras_tp.plan import trace as tracing  # noqa: E402

keras_tp.configure_virtual_devices(4)

from tests import blocked_cases  # noqa: E402
from tests import models  # noqa: E402
from tests import zoo  # noqa: E402
from tests import zoo_cases  # noqa: E402
from tests.test_jax import _count_hlo  # noqa: E402

_runs = {}


def _measured(name, world_size):
    """`zoo_cases.measured`, run once per model and world size."""
    if (name, world_size) not in _runs:
        _runs[name, world_size] = zoo_cases.measured(name, world_size)
    return _runs[name, world_size]


def measure(name, world_size):
    """`zoo_cases.measure`, run once per model and world size."""
    return _measured(name, world_size)[0]


def _summed(name):
    """The whole layers of zoo LM `name` that sum their gradients
    (`zoo_cases.SUMMED_PER_BLOCK`)."""
    return zoo_cases.BLOCKS * zoo_cases.SUMMED_PER_BLOCK.get(name, 0)


def _trained_step_hlo(name):
    """`(split model, its compiled training step's HLO text)` of zoo model
    `name` at TP=2, the model `measure` trained 2 SGD steps."""
    _, tp, x, y = _measured(name, 2)
    state = (
        [v.value for v in tp.trainable_variables],
        [v.value for v in tp.non_trainable_variables],
        [v.value for v in tp.optimizer.variables],
        [v.value for v in tp.metrics_variables],
    )
    return tp, jax.jit(tp.train_step).lower(state, (x, y)).compile().as_text()


def _compiled_collectives(name):
    """`(tp, {kind: ops})`: the all-reduces, all-gathers and
    collective-permutes in zoo `name`'s compiled training step."""
    tp, hlo = _trained_step_hlo(name)
    kinds = ("all-reduce", "all-gather", "collective-permute")
    return tp, {kind: _count_hlo(hlo, kind) for kind in kinds}


# CLIP runs on the backends whose ranks hold their own slices (torch,
# TensorFlow), where its twin variable paths once went wrong; JAX's global
# arrays were exact, and `test_jax.py` checks the planner's rule for them.
@pytest.mark.parametrize(
    "name", [n for n in zoo_cases.TRANSFORMERS if n != "clip"]
)
def test_transformer_families_exact_at_two_ranks(name):
    results = measure(name, 2)
    zoo_cases.check_exact(results)
    # JAX without a data axis runs the code between regions on global
    # arrays: nothing needs to fall back.
    assert not results["fallbacks"]
    if name in zoo_cases.DECODER_LMS:
        zoo_cases.check_megatron(results, _summed(name))
    if name not in ("gemma", "gemma_lora"):
        # Only norms and position tables stay whole.
        assert results["bytes_ratio"] <= 1.05, results["bytes_ratio"]
    if name == "mixtral":
        # Each rank holds half of every layer's experts.
        experts = [s for s in results["plan"].values() if "Expert" in s]
        assert experts == [repr(keras_tp.ExpertParallel(0))] * 2
        # Its routers stay whole: the one all-gather forward per block is
        # its experts' outputs'.
        zoo_cases.check_small_layers_whole(name, results)
        gathers = results["collectives"]["all_gather"]["forward"]
        assert gathers == zoo_cases.BLOCKS, results["collectives"]


def test_fused_projections_split_by_blocks_in_per_rank_steps(tmp_path):
    # On global arrays the code between regions would read a blocked
    # Column's output in its stored layout: the steps run per rank.
    results = blocked_cases.blocked_results(2, str(tmp_path), swin=False)
    blocked_cases.check_blocked(results)
    # No collective of the compiled step goes uncounted: XLA moves no
    # heads between the devices.
    tp, counts = _compiled_collectives("fused")
    stats = tp.communication_stats()
    assert counts == {
        "all-reduce": stats["all_reduce"]["calls"],
        "all-gather": 0,
        "collective-permute": 0,
    }, (counts, stats)


def test_swin_attention_pairs_by_blocks_in_per_rank_steps():
    # Its steps run per rank, where every collective of the compiled step
    # is counted.
    blocked_cases.check_swin(measure("swin", 2))
    tp, counts = _compiled_collectives("swin")
    assert tp.sharding_plan.variable_blocks()
    stats = tp.communication_stats()
    assert counts == {
        "all-reduce": stats["all_reduce"]["calls"],
        "all-gather": stats["all_gather"]["calls"],
        "collective-permute": 0,
    }, (counts, stats)


def test_fused_projections_split_by_blocks_under_zero3(tmp_path):
    blocked_cases.check_zero(blocked_cases.zero_results(str(tmp_path)))


def test_lora_split_by_blocks_and_a_checkpoint_resharded(tmp_path):
    blocked_cases.check_reshard(blocked_cases.reshard_results(str(tmp_path)))


def test_a_user_plan_splits_by_blocks_but_not_in_pipeline_stages():
    blocked_cases.check_user_plan(blocked_cases.user_plan_results())


def test_a_trace_of_ones_own_refuses_columns_split_by_blocks():
    # It would run the code between the split layers on global arrays.
    model, x, _ = zoo.fused()
    tp = keras_tp.TensorParallelKeras(model, world_size=2)
    with pytest.raises(keras_tp.ShardingError, match="stored order"):
        jax.jit(lambda inputs: tp(inputs))(x)


def test_a_fused_projection_laid_out_block_by_block_gathers_what_it_counts():
    # Qwen3.5's linear attention projects its queries, keys and values
    # block by block: the first rank's contiguous part of the fused
    # projection reaches every head of the output projection's input
    # (`plan/dependence.py`), so they are no Megatron pair. Paired on
    # global arrays, XLA moved the heads itself (3 all-gathers and 6
    # collective-permutes per step that no count showed); now the
    # projections gather their outputs (`zoo_cases`), and the compiled
    # step holds no collective beyond the counted ones.
    zoo_cases.check_block_by_block_gathers(measure("qwen3_5", 2))
    _, hlo = _trained_step_hlo("qwen3_5")
    assert _count_hlo(hlo, "all-gather") == 3
    assert _count_hlo(hlo, "collective-permute") == 0


def test_an_argument_multiplied_into_split_features_enters_split():
    # Gemma3n's block multiplies its per-layer input, whole, into its
    # gate's output, split by features, before the projection back. Each
    # device takes its part of that input in a counted scatter (before,
    # XLA gathered its gradient, 2 all-gathers that no count showed, and
    # the ranks' view of the plan failed, so its summed norms went
    # uncounted too): every collective of the compiled step is counted.
    results = measure("gemma3n", 2)
    zoo_cases.check_exact(results)
    assert not results["fallbacks"], results["fallbacks"]
    tp, hlo = _trained_step_hlo("gemma3n")
    stats = tp.communication_stats()
    assert _count_hlo(hlo, "all-gather") == stats["all_gather"]["calls"]
    assert _count_hlo(hlo, "all-reduce") == stats["all_reduce"]["calls"]
    # One backward all-gather per block: the per-layer input's gradient.
    assert stats["all_gather"]["backward_calls"] == zoo_cases.BLOCKS


def test_raw_ops_pair_a_row_only_with_the_rank_parts_they_carry():
    # RWKV-7's key projection reads the block's input, not the receptance
    # projection's output beside it: all three of its time mix's
    # projections reach the output projection, head by head, and form one
    # pair on global arrays (where ranks hold their own slices, a rank's
    # heads meet a whole value of the same width, and the check falls
    # back to gathering Columns).
    # FNet's Fourier transform reads every feature of the embedding
    # projection's output: that projection gathers it.
    rwkv = zoo.ZOO["rwkv7"]()[0]
    plan = keras_tp.auto_plan(rwkv, tensor_parallel=2, check_local=False)
    styles = {e.layer.path: e.style for e in plan.leaf_layers()}
    for block in range(zoo_cases.BLOCKS):
        mix = f"rwkv_layer_{block}/RWKV_TIME_MIX/"
        for name in ("receptance", "key", "value"):
            assert styles[mix + name] == keras_tp.Column(), styles
        assert styles[mix + "output_layer"] == keras_tp.Row(), styles
    plan = keras_tp.auto_plan(zoo.ZOO["fnet"]()[0], tensor_parallel=2)
    styles = {e.layer.path: e.style for e in plan.leaf_layers()}
    gathering = keras_tp.Column(gather_output=True)
    assert styles["embedding_projection"] == gathering, styles


def test_resnet_pairs_convolutions_through_batchnorm():
    zoo_cases.check_resnet(zoo_cases.cnn_checks("resnet50", 2))


def test_separable_convolutions_pair_through_batchnorm():
    zoo_cases.check_separable(measure("separable_cnn", 2))
    # The grouped convolution, split by its groups, runs mapped over the
    # ranks: on global arrays XLA gathered its input and kernel instead, in
    # 4 all-gathers per step that no count showed.
    tp, hlo = _trained_step_hlo("separable_cnn")
    stats = tp.communication_stats()
    assert _count_hlo(hlo, "all-gather") == stats["all_gather"]["calls"] == 2
    assert _count_hlo(hlo, "all-reduce") <= stats["all_reduce"]["calls"]
    assert _count_hlo(hlo, "collective-permute") == 0


@pytest.mark.parametrize("name", ["gpt2", "qwen3", "mixtral"])
def test_four_ranks(name):
    results = measure(name, 4)
    zoo_cases.check_exact(results)
    if name == "mixtral":
        # Its 4 experts: one per rank.
        assert results["bytes_ratio"] <= 1.05, results["bytes_ratio"]
    if name in zoo_cases.DECODER_LMS:
        zoo_cases.check_megatron(results, _summed(name))


def test_multi_query_attention_keeps_the_key_value_head_whole():
    results = measure("gemma", 2)
    whole = [p for p, r in results["replicated"].items() if "heads" in r]
    assert sorted(whole) == [
        f"decoder_block_{i}/attention/{kind}"
        for i in range(zoo_cases.BLOCKS)
        for kind in ("key", "value")
    ]
    query = results["plan"]["decoder_block_0/attention/query"]
    assert query == repr(keras_tp.Column())


def test_tied_lm_head_shares_the_vocabulary_split():
    model, x, _ = zoo.ZOO["gpt2"]()
    tp = keras_tp.TensorParallelKeras(model, world_size=4)
    embedding = model.backbone.token_embedding
    shards = embedding.embeddings.value.addressable_shards
    assert shards[0].data.shape == (embedding.input_dim // 4, 32)
    assert tuple(tp(x).shape) == (4, 8, embedding.input_dim)


@pytest.mark.parametrize("name", ["llama", "gemma", "qwen3"])
def test_compiled_step_has_the_counted_collectives(name):
    # Gemma's one key/value head stays whole while its query heads are
    # split: its steps run per rank, where the ranks sum the key and value
    # weights' gradients in counted all-reduces (on global arrays XLA
    # all-reduced their outputs' gradients, uncounted). Qwen3's norms of
    # each query and key head run on each device's heads, where they sum
    # their weights' gradients in counted all-reduces (XLA added 4).
    tp, hlo = _trained_step_hlo(name)
    assert tp.sharding_plan.summed_by_xla == (
        [
            f"decoder_block_{i}/attention/{kind}"
            for i in range(zoo_cases.BLOCKS)
            for kind in ("key", "value")
        ]
        if name == "gemma"
        else []
    )
    stats = tp.communication_stats()
    # The loss and the accuracy metric each all-reduce the logits' maximum
    # over the vocabulary shards: one computation, which XLA runs once.
    assert _count_hlo(hlo, "all-reduce") == stats["all_reduce"]["calls"] - 1
    # The logits stay split by vocabulary: nothing is gathered.
    assert _count_hlo(hlo, "all-gather") == 0
    megatron = 2 * (2 * zoo_cases.BLOCKS + 1)
    loss = zoo_cases.LOSS_AND_ACCURACY_REDUCTIONS
    summed = _summed(name)
    assert stats["all_reduce"]["calls"] == megatron + loss + summed
    assert "all_gather" not in stats


def test_plan_sources_and_lora_after_wrapping():
    model, _, _ = zoo.ZOO["llama"]()
    tp = keras_tp.TensorParallelKeras(model, world_size=2)
    sources = tp.sharding_plan.sources
    # Llama ships a layout map: it decides every layer it lists. Its
    # query/key/value entries name the hidden axis; the Megatron pairing
    # splits the heads, which needs no all-reduce between them.
    assert sources["transformer_layer_0/feedforward_output_dense"] == (
        "model layout map"
    )
    assert sources["transformer_layer_0/self_attention/query"] == (
        "model layout map (Megatron axis)"
    )
    lines = []
    tp.summary(print_fn=lines.append)
    assert "model layout map (Megatron axis)" in "\n".join(lines)
    # GPT-2 ships none: the automatic plan decides.
    gpt2 = keras_tp.TensorParallelKeras(zoo.ZOO["gpt2"]()[0], world_size=2)
    assert set(gpt2.sharding_plan.sources.values()) <= {
        "auto: Column -> Row",
        "auto: alone",
        "auto: attention heads",
    }
    block = model.backbone.get_layer("transformer_layer_0")
    dense = block._feedforward_output_dense
    with pytest.raises(ValueError, match="Enable LoRA before wrapping"):
        dense.enable_lora(2)


def test_mixed_bfloat16_trains_at_parity():
    zoo_cases.check_mixed_precision(*zoo_cases.mixed_precision("llama", 2))


def test_int8_quantized_layers_stay_whole_or_are_refused():
    def build():
        model, x, _ = zoo.ZOO["llama"]()
        model.quantize("int8")
        return model, x

    reference, x = build()
    tp = keras_tp.TensorParallelKeras(build()[0], world_size=2)
    reasons = tp.sharding_plan.replicated
    assert reasons["transformer_layer_0/feedforward_output_dense"] == (
        "quantized (int8)"
    )
    np.testing.assert_allclose(tp(x), reference(x), atol=1e-5)
    # The reference is not needed any more: the refusal is its last use.
    with pytest.raises(keras_tp.ShardingError, match="quantized \\(int8\\)"):
        keras_tp.TensorParallelKeras(
            reference,
            world_size=2,
            plan={
                "transformer_layer_0/feedforward_output_dense/kernel": (
                    keras_tp.Row()
                )
            },
        )


def test_a_keras_hub_task_trains_as_it_compiled_itself():
    # keras-hub tasks compile themselves when made: wrapped, the split
    # model trains without a compile(), and compile() fills in the task's
    # own "auto" loss and weighted metrics.
    reference, x, y = zoo.ZOO["gpt2"]()
    tp = keras_tp.TensorParallelKeras(zoo.ZOO["gpt2"]()[0], world_size=2)
    assert tp.compiled
    for model in (reference, tp):
        model.fit(x, y, epochs=2, shuffle=False, verbose=0)
    assert models.max_diff(tp.get_weights(), reference.get_weights()) < 1e-5
    for model in (reference, tp):
        model.compile(optimizer="adam")
        model.fit(x, y, epochs=2, shuffle=False, verbose=0)
    assert models.max_diff(tp.get_weights(), reference.get_weights()) < 1e-5
    assert tp.evaluate(x, y, return_dict=True, verbose=0) == pytest.approx(
        reference.evaluate(x, y, return_dict=True, verbose=0)
    )


def test_a_model_that_needs_real_sizes_is_traced_on_a_larger_probe():
    # Moonshine's audio encoder fails on 8 samples and 128: the planner
    # traces it on 1,024 (`PROBE_LENGTHS`) without a sample batch. Its
    # rotary table is as wide as its heads count; the check's trials
    # leave it whole, and every attention layer splits by heads.
    reference, x = zoo.moonshine()
    tp = keras_tp.TensorParallelKeras(zoo.moonshine()[0], world_size=2)
    assert not tp.sharding_plan.fallbacks
    sharded = tp.get_parallelism_info()["sharded_layers"]
    assert "encoder_block_0/self_attention_layer" in sharded

    # The backbone returns its padding masks too: compare the features.
    def features(outputs):
        return [o for o in keras.tree.flatten(outputs) if o.dtype != "bool"]

    assert models.max_diff(features(tp(x)), features(reference(x))) < 1e-5
    # A model of one length only fails on every probe: the note says to
    # pass a sample batch, with which it splits.
    model, x = fixed_length_model()
    with pytest.raises(ValueError) as caught:
        keras_tp.TensorParallelKeras(model, world_size=2)
    notes = "".join(caught.value.__notes__)
    assert "each of (8, 128, 1024) in turn" in notes
    assert "pass sample_batch=" in notes
    tp = keras_tp.TensorParallelKeras(model, world_size=2, sample_batch=x)
    assert tp.sharding_plan.leaf_layers()
    assert models.max_diff(tp(x), model(x)) < 1e-5
    # A larger probe stays under PROBE_ELEMENTS numbers: with three
    # unknown dimensions (SAM's masks), 1,024 each is not tried.
    inputs = keras.Input((None, None, None, 1))
    volumes = keras.Model(inputs, keras.layers.Dense(2)(inputs))
    limit = tracing.PROBE_ELEMENTS
    probe = tracing.probe_inputs(volumes, length=128, max_elements=limit)
    assert tuple(probe.shape) == (2, 128, 128, 128, 1)
    assert (
        tracing.probe_inputs(volumes, length=1024, max_elements=limit) is None
    )


class AddedPositions(keras.layers.Layer):
    """Adds a learned table of `length` positions to its inputs."""

    def __init__(self, length, **kwargs):
        super().__init__(**kwargs)
        self.length = length

    def build(self, input_shape):
        self.table = self.add_weight((self.length, input_shape[-1]))

    def call(self, inputs):
        return inputs + self.table

    def compute_output_shape(self, input_shape):
        return input_shape


def fixed_length_model(length=10):
    """A Functional model whose unknown sequence length must be `length`
    (`AddedPositions`), and a batch."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((None, 16))
    h = AddedPositions(length)(inputs)
    h = keras.layers.Dense(32, activation="relu")(h)
    outputs = keras.layers.Dense(16)(h)
    x = np.random.default_rng(1).normal(size=(2, length, 16))
    return keras.Model(inputs, outputs), x.astype("float32")


# Gemma's attention alone, split by a user's plan: its single key/value
# head stays whole, as the plan leaves it.
GEMMA_ATTENTION = {
    "attention/query/kernel": keras_tp.Column(),
    "attention/attention_output/kernel": keras_tp.Row(),
}


@pytest.mark.parametrize("plan", ["auto", "user"])
def test_each_device_runs_its_heads_with_a_data_axis(plan):
    # With a data axis each device runs the code between regions on its
    # own slices, as torch's ranks do: Gemma's attention reads its own
    # head counts, and its whole key/value head sums its gradients over
    # the ranks, found for a user's plan too (it was silently partial).
    wrap = {} if plan == "auto" else {"plan": GEMMA_ATTENTION}
    reference, tp = zoo_cases.trained("gemma", 4, data_parallel=2, **wrap)
    assert not tp.sharding_plan.fallbacks, tp.sharding_plan.fallbacks
    assert models.max_diff(tp.get_weights(), reference.get_weights()) < 1e-5
    stats = tp.communication_stats("train", axis="model")["all_reduce"]
    summed = zoo_cases.BLOCKS * zoo_cases.SUMMED_PER_BLOCK["gemma"]
    assert len(tp.sharding_plan.summed_gradients) == summed
    # Auto: Megatron's pairs, the LM head's input and the summed layers;
    # the user's plan splits only each block's attention.
    pairs = 2 * zoo_cases.BLOCKS + 1 if plan == "auto" else zoo_cases.BLOCKS
    assert stats["backward_calls"] == pairs + summed


@pytest.mark.parametrize("name", ["t5", "t5gemma2"])
def test_encoder_decoder_attention_pairs_with_a_data_axis(name):
    # T5's attention reshapes to its `inner_dim` and hands the position
    # bias its first layer computes (from its heads' slice of the bias
    # table) to the next; its head size and its 32 position buckets equal
    # a heads count and a width by chance. T5Gemma2's merged attention
    # takes `cache=(self, cross)`, (None, None) in training: each cache of
    # the pair is split on its heads alone. Both pair with no gathers.
    reference, tp = zoo_cases.trained(name, 4, data_parallel=2)
    assert not tp.sharding_plan.fallbacks, tp.sharding_plan.fallbacks
    assert models.max_diff(tp.get_weights(), reference.get_weights()) < 1e-5
    stats = tp.communication_stats("train", axis="model")
    assert stats.get("all_gather", {}).get("forward_calls", 0) == 0, stats


# Falcon's and GPT-NeoX's attention flatten their heads into features
# (reshapes to `num_heads * head_dim` and to `hidden_dim`), and Falcon's
# decoder block hands its attention an ALiBi bias for every head. Bloom's
# attention biases its scores with an `AlibiBias` layer that gives each
# head the slope of its index among the scores' heads. With a data axis
# each device runs that code on its own heads: it reads its head counts
# and its heads' slice of the bias, and runs the `AlibiBias` on all heads
# (its own in place), so the attention pairs as Megatron's, with no
# gathers (it was a gathering Column and a slicing Row). The views the
# plan's check rejects on the way log nothing (Keras' JAX backend logged
# a traceback for GPT-NeoX's, whose fused attention it falls back from).
@pytest.mark.parametrize("name", ["falcon", "bloom", "gpt_neox"])
def test_flattened_heads_pair_with_a_data_axis(name, caplog):
    with caplog.at_level(logging.ERROR, logger="absl"):
        results = zoo_cases.measure(name, 4, data_parallel=2)
    assert not caplog.records, caplog.records[0].getMessage()
    zoo_cases.check_exact(results)
    assert not results["fallbacks"], results["fallbacks"]
    zoo_cases.check_megatron(results)
