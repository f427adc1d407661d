"""keras-hub models split on TensorFlow: replicas on 4 virtual CPUs.

Run with `KERAS_BACKEND=tensorflow python -m pytest
tests/test_tensorflow_zoo.py`. The checks are shared with JAX and torch in
`tests/zoo_cases.py`.
"""

import keras
import pytest

if keras.backend.backend() != "tensorflow":
    pytest.skip(
        "TensorFlow backend tests; run with KERAS_BACKEND=tensorflow",
        allow_module_level=True,
    )

import keras_tp  # noqa: E402

keras_tp.configure_virtual_devices(4)

from tests import blocked_cases  # noqa: E402
from tests import models  # noqa: E402
from tests import zoo_cases  # noqa: E402

_runs = {}


def measure(name):
    if name not in _runs:
        _runs[name] = zoo_cases.measure(name, 2)
    return _runs[name]


# Mixtral's router adds its load-balancing loss in the forward pass: each
# replica records the losses its layers add, and the step adds them to
# the loss it computes outside the replicas.
@pytest.mark.parametrize("name", [*zoo_cases.TRANSFORMERS, "falcon"])
def test_exact_at_two_replicas(name):
    results = measure(name)
    zoo_cases.check_exact(results)
    if name in (*zoo_cases.DECODER_LMS, "falcon"):
        # The Megatron minimum: see test_torch_zoo.py.
        assert not results["fallbacks"], results["fallbacks"]
        zoo_cases.check_megatron(
            results,
            zoo_cases.BLOCKS * zoo_cases.SUMMED_PER_BLOCK.get(name, 0),
        )


def test_fused_projections_split_by_blocks(tmp_path):
    results = blocked_cases.blocked_results(2, str(tmp_path))
    blocked_cases.check_blocked(results)
    blocked_cases.check_swin(results["swin"])


def test_fused_projections_split_by_blocks_under_zero3(tmp_path):
    blocked_cases.check_zero(blocked_cases.zero_results(str(tmp_path)))


def test_fused_projections_gather_in_pipeline_stages():
    blocked_cases.check_pipeline(blocked_cases.pipeline_results())


def test_lora_split_by_blocks_and_a_checkpoint_resharded(tmp_path):
    blocked_cases.check_reshard(blocked_cases.reshard_results(str(tmp_path)))


def test_a_user_plan_splits_by_blocks_but_not_in_pipeline_stages():
    blocked_cases.check_user_plan(blocked_cases.user_plan_results())


def test_a_fused_projection_laid_out_block_by_block_gathers():
    zoo_cases.check_block_by_block_gathers(zoo_cases.measure("qwen3_5", 2))


def test_an_attention_given_per_head_weights_splits_by_heads():
    # XLNet: see test_jax.py. Each replica takes its heads' slice of the
    # per-head biases its block hands to the attention.
    results = zoo_cases.measure("xlnet", 2)
    zoo_cases.check_exact(results)
    assert not results["fallbacks"], results["fallbacks"]
    assert results["bytes_ratio"] <= 1.05, results["bytes_ratio"]


def test_resnet_pairs_convolutions_through_batchnorm():
    zoo_cases.check_resnet(zoo_cases.cnn_checks("resnet50", 2))


def test_separable_convolutions_pair_through_batchnorm():
    zoo_cases.check_separable(zoo_cases.measure("separable_cnn", 2))


def test_a_task_that_holds_its_optimizer_saves(tmp_path):
    # A keras-hub task compiled by its own compile() holds the optimizer,
    # whose state Keras writes with the model: it is assembled whole too.
    reference, tp, x, y = zoo_cases.pair("gpt2", 2)
    for model in (reference, tp):
        model.compile(optimizer="adam")
        model.fit(x, y, epochs=1, shuffle=False, verbose=0)
    tp.save(tmp_path / "gpt2.keras")
    loaded = keras.saving.load_model(tmp_path / "gpt2.keras")
    assert models.max_diff(loaded.get_weights(), reference.get_weights()) < 1e-5


def test_mixed_float16_trains_at_parity():
    # Loss scaling whose overflow check spans the replicas (a
    # GlobalLossScaleOptimizer); JAX's CPU has no float16 dot with float32
    # accumulation, so it runs on GPUs only there.
    result = zoo_cases.mixed_precision("llama", 2, "mixed_float16")
    zoo_cases.check_mixed_precision(*result)
