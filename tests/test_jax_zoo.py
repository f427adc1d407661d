"""keras-hub and keras.applications models split on JAX (4 devices).

Run with `KERAS_BACKEND=jax python -m pytest tests/test_jax_zoo.py`. The
models come from `tests/zoo.py` (tiny configs, random weights, offline);
the checks are shared with torch and TensorFlow in `tests/zoo_cases.py`.
"""

import keras
import numpy as np
import pytest

if keras.backend.backend() != "jax":
    pytest.skip(
        "JAX backend tests; run with KERAS_BACKEND=jax",
        allow_module_level=True,
    )

import keras_tp  # noqa: E402

keras_tp.configure_virtual_devices(4)

from tests import zoo  # noqa: E402
from tests import zoo_cases  # noqa: E402



_runs = {}


def measure(name, world_size):
    """`zoo_cases.measure`, run once per model and world size."""
    if (name, world_size) not in _runs:
        _runs[name, world_size] = zoo_cases.measure(name, world_size)
    return _runs[name, world_size]


@pytest.mark.parametrize("name", zoo_cases.TRANSFORMERS)
def test_transformer_families_exact_at_two_ranks(name):
    results = measure(name, 2)
    zoo_cases.check_exact(results)
    # JAX without a data axis runs the code between regions on global
    # arrays: nothing needs to fall back.
    assert not results["fallbacks"]
    if name in zoo_cases.DECODER_LMS:
        zoo_cases.check_megatron_forward(results)
    if name not in ("gemma", "mixtral"):
        # Only norms and position tables stay whole.
        assert results["bytes_ratio"] <= 1.05, results["bytes_ratio"]


@pytest.mark.parametrize("name", ["gpt2", "qwen3"])
def test_four_ranks(name):
    results = measure(name, 4)
    zoo_cases.check_exact(results)
    if name in zoo_cases.DECODER_LMS:
        zoo_cases.check_megatron_forward(results)


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


@pytest.mark.parametrize("name", ["efficientnetb0"])
def test_cnns_forward_exact(name):
    reference, x, _ = zoo.ZOO[name]()
    tp = keras_tp.TensorParallelKeras(zoo.ZOO[name]()[0], world_size=2)
    difference = np.max(np.abs(np.asarray(tp(x)) - np.asarray(reference(x))))
    assert difference <= 1e-5
