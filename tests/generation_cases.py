"""Generation's checks, shared by every backend.

`runs` generates with keras-hub causal LMs on one device and split
(`TensorParallelKeras.generate`), greedy and with a seeded top-k sampler,
from prompts of different lengths, and measures the key/value cache each
device holds after the prompt. It returns plain numbers and arrays, so a
torch rank can hand them back.
"""

import keras
import keras_hub
import numpy as np
from keras import ops

import keras_tp
from keras_tp.tensors import nbytes
from tests import zoo

PROMPT_LENGTHS = (3, 5)
MAX_LENGTH = 10


def qwen(seed=0):
    """A tiny `QwenCausalLM` (Qwen2): 4 query heads share 2 key/value
    heads, so at TP=2 each rank holds one key/value head."""
    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.QwenBackbone(
        vocabulary_size=zoo.VOCAB,
        num_layers=2,
        num_query_heads=4,
        num_key_value_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        dropout=0.0,
    )
    return keras_hub.models.QwenCausalLM(backbone=backbone, preprocessor=None)


FAMILIES = {
    "gpt2": lambda: zoo.gpt2()[0],
    "llama": lambda: zoo.llama()[0],
    "gemma": lambda: zoo.gemma()[0],
    "qwen": qwen,
    # Its linear-attention block hands its slice of the task's key/value
    # cache back unchanged, beside the full attention's split one.
    "qwen3_5": lambda: zoo.qwen3_5()[0],
}


def prompt():
    """Token ids padded to `MAX_LENGTH`, one prompt length per row."""
    rng = np.random.default_rng(5)
    ids = np.zeros((len(PROMPT_LENGTHS), MAX_LENGTH), "int32")
    mask = np.zeros(ids.shape, bool)
    for row, length in enumerate(PROMPT_LENGTHS):
        ids[row, :length] = rng.integers(1, zoo.VOCAB, length)
        mask[row, :length] = True
    return {"token_ids": ids, "padding_mask": mask}


def bytes_per_device(x):
    """The most bytes of `x` one device holds, read from the arrays: a JAX
    array's shards, a TensorFlow per-replica value's components, a torch
    rank's tensor."""
    shards = getattr(x, "addressable_shards", None)
    if shards:
        return max(shard.data.nbytes for shard in shards)
    components = getattr(x, "values", None)
    if isinstance(components, tuple):
        return max(nbytes(component) for component in components)
    return nbytes(x)


def _generate(model, generate, sampler):
    model.compile(sampler=sampler)
    outputs = generate(prompt(), stop_token_ids=None)
    return ops.convert_to_numpy(outputs["token_ids"])


def run(family, world_size, sampled=False, cache=False, compiled=None):
    """One family on one device, then wrapped: its tokens, greedy (and
    with a seeded top-k sampler), and the bytes of the key/value cache
    each device holds after the prompt, read from the arrays (the call
    that fills it `compiled` by the backend's compiler where given)."""
    model = FAMILIES[family]()
    samplers = {"greedy": lambda: "greedy"}
    if sampled:
        samplers["top_k"] = lambda: keras_hub.samplers.TopKSampler(4, seed=3)
    shapes = []
    call_with_cache = model.call_with_cache

    def recording(token_ids, cache, *args, **kwargs):
        shapes.append(keras.tree.map_structure(lambda t: tuple(t.shape), cache))
        return call_with_cache(token_ids, cache, *args, **kwargs)

    expected = {}
    for name, sampler in samplers.items():
        model.call_with_cache = recording
        expected[name] = _generate(model, model.generate, sampler())
        del model.call_with_cache
    tp = keras_tp.TensorParallelKeras(model, world_size=world_size)
    result = {
        "expected": expected,
        "got": {
            name: _generate(model, tp.generate, sampler())
            for name, sampler in samplers.items()
        },
    }
    if cache:
        # The whole cache the task makes for the prompt, and the cache
        # each device keeps after the prompt has passed.
        whole = ops.zeros(shapes[0])
        ids = ops.convert_to_tensor(prompt()["token_ids"])

        def fill(ids, whole):
            return model.call_with_cache(ids, whole, 0)[2]

        if compiled is not None:
            fill = compiled(fill)
        with tp._runtime.generating(model):
            split = fill(ids, whole)
        result["cache_bytes"] = bytes_per_device(split)
        result["one_device_cache_bytes"] = bytes_per_device(whole)
    return result


def runs(
    world_size,
    families=tuple(FAMILIES),
    sampled=("gpt2",),
    cache=("gpt2", "llama", "gemma"),
    compiled=None,
):
    """`{family: run(...)}`, sampled and cache measured where listed."""
    return {
        family: run(
            family, world_size, family in sampled, family in cache, compiled
        )
        for family in families
    }


# The families whose key/value heads the plan splits at TP=2; Gemma's
# single key/value head stays whole, and so does its cache.
SPLIT_CACHES = ("gpt2", "llama", "qwen")


def check_runs(results, world_size, split_caches=SPLIT_CACHES):
    """Greedy and seeded top-k tokens equal one device's; the cache on
    each device is 1/T of one device's where heads split, whole where
    they stay whole."""
    for family, result in results.items():
        for sampler, tokens in result["expected"].items():
            np.testing.assert_array_equal(
                result["got"][sampler], tokens, err_msg=f"{family} {sampler}"
            )
        if "cache_bytes" in result:
            share = result["cache_bytes"] / result["one_device_cache_bytes"]
            expected = 1 / world_size if family in split_caches else 1
            assert share == expected, (family, share)
