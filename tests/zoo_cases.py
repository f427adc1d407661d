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
import numpy as np

import keras_tp
from tests import zoo

_ROW = keras_tp.Row()

TRANSFORMERS = (
    "gemma",
    "gpt2",
    "llama",
    "mistral",
    "qwen3",
    "phi3",
    "mixtral",
    "distilbert",
    "roberta",
    "bert",
    "vit",
    "bart",
    "t5",
)
# Decoder-only LMs of the zoo: 2 blocks, token embedding and LM head in one
# ReversibleEmbedding (tied or not).
DECODER_LMS = ("gemma", "gpt2", "llama", "mistral", "qwen3", "phi3")
BLOCKS = 2


def check_megatron_forward(results):
    """A decoder LM's forward pass costs Megatron's minimum on `model`.

    One all-reduce per attention and per MLP (the Row layers), one for the
    vocabulary-parallel embedding, and one all-gather of the logits.
    """
    rows = [s for s in results["plan"].values() if s == repr(_ROW)]
    assert len(rows) == 2 * BLOCKS, results["plan"]
    collectives = results["collectives"]
    assert collectives["all_reduce"]["forward"] == 2 * BLOCKS + 1
    assert collectives["all_gather"] == {"forward": 1, "backward": 0}


def check_exact(results, tolerance=1e-5):
    assert results["forward"] <= tolerance, results
    assert results["weights"] <= tolerance, results


def measure(name, world_size, **wrap_kwargs):
    """Runs the zoo checks of model `name` split `world_size` ways."""
    reference, x, y = zoo.ZOO[name]()
    tp = keras_tp.TensorParallelKeras(
        zoo.ZOO[name]()[0], world_size=world_size, **wrap_kwargs
    )
    results = {"forward": _largest(tp(x), reference(x))}
    for model in (reference, tp):
        model.compile(
            optimizer=keras.optimizers.SGD(1e-2), loss=zoo.loss_for(name)
        )
        for _ in range(2):
            model.train_on_batch(x, y)
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
    return results


def adam_difference(name, world_size, **wrap_kwargs):
    """Weights after 2 Adam steps, split against one device."""
    reference, x, y = zoo.ZOO[name]()
    tp = keras_tp.TensorParallelKeras(
        zoo.ZOO[name]()[0], world_size=world_size, **wrap_kwargs
    )
    for model in (reference, tp):
        model.compile(
            optimizer=keras.optimizers.Adam(1e-3), loss=zoo.loss_for(name)
        )
        for _ in range(2):
            model.train_on_batch(x, y)
    return _largest(tp.get_weights(), reference.get_weights())


def _largest(a, b):
    a = keras.tree.flatten(a)
    b = keras.tree.flatten(b)
    return max(
        float(np.max(np.abs(np.asarray(x, "float64") - np.asarray(y))))
        for x, y in zip(
            [keras.ops.convert_to_numpy(t) for t in a],
            [keras.ops.convert_to_numpy(t) for t in b],
        )
    )
