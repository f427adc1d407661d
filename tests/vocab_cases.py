"""The vocabulary-parallel loss's checks, shared by every backend.

`runs` trains the demo's transformer LM (a `Dense` LM head) on one device
and split, with padding-like sample weights, once with the accuracy
metric, which reads split logits, and once with top-5 accuracy, which
needs them whole; it returns plain numbers, so a torch rank can hand them
back.
"""

import keras
import numpy as np

import keras_tp
from tests import models
from tests.models import max_diff

BATCH = 8


def adam():
    return keras.optimizers.Adam(1e-2)


def _trained(model, x, y, weights, metrics, optimizer):
    """`(history, evaluation)` of `model` compiled with `metrics`."""
    model.compile(
        optimizer=optimizer(),
        loss=models.loss_fn(),
        weighted_metrics=metrics,
    )
    fit = model.fit(
        x,
        y,
        sample_weight=weights,
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
    )
    evaluation = model.evaluate(
        x,
        y,
        sample_weight=weights,
        batch_size=BATCH,
        verbose=0,
        return_dict=True,
    )
    return fit.history, evaluation


def runs(world_size, data_parallel=1, optimizer=adam):
    """`{"split": ..., "whole": ...}`: the split model trained with the
    accuracy metric (split logits) and with top-5 accuracy (whole ones),
    each next to one device trained once with both metrics. `optimizer`
    makes each model's optimizer."""
    x, y = models.data_for("transformer_lm", batch=2 * BATCH)
    weights = (np.random.default_rng(3).random(y.shape) > 0.3).astype("f4")
    metrics = {
        "split": ["accuracy"],
        "whole": [keras.metrics.SparseTopKCategoricalAccuracy(5)],
    }
    reference = models.transformer_lm()
    history, evaluation = _trained(
        reference,
        x,
        y,
        weights,
        ["accuracy", keras.metrics.SparseTopKCategoricalAccuracy(5)],
        optimizer,
    )
    results, wrapped = {}, {}
    for name, metric in metrics.items():
        tp = keras_tp.TensorParallelKeras(
            models.transformer_lm(),
            world_size=world_size,
            data_parallel=data_parallel,
        )
        wrapped[name] = tp
        tp_history, tp_evaluation = _trained(
            tp, x, y, weights, metric, optimizer
        )
        results[name] = {
            "head": tp.get_parallelism_info()["vocab_parallel_head"],
            "history": max(
                max_diff(history[k], tp_history[k]) for k in tp_history
            ),
            "evaluate": max(
                abs(evaluation[k] - tp_evaluation[k]) for k in tp_evaluation
            ),
            "train": tp.communication_stats("train", axis="model"),
            "test": tp.communication_stats("test", axis="model"),
        }
    # Prediction gathers the logits whatever the metrics.
    results["split"]["predict"] = max_diff(
        [reference.predict(x, verbose=0)],
        [wrapped["split"].predict(x, verbose=0)],
    )
    return results


def check_runs(results):
    """Exact against one device either way; split logits are never
    gathered in training or evaluation, whole ones once per step.

    Args:
        results: `runs`.
    """
    for run in results.values():
        assert run["history"] < 1e-5, run
        assert run["evaluate"] < 1e-5, run
    # Logits after 4 Adam steps at 1e-2: float32 rounding of each
    # backend's reductions, as the demo's parity check allows.
    assert results["split"]["predict"] < 1e-4, results["split"]
    assert results["whole"]["head"] is None
    assert results["split"]["head"] == "lm_head"
    for phase in ("train", "test"):
        split_gathers = results["split"][phase].get("all_gather", {})
        whole_gathers = results["whole"][phase]["all_gather"]
        assert whole_gathers["forward_calls"] == 1, whole_gathers
        assert not split_gathers, results["split"][phase]
        # The loss's maximum and sums, the accuracy's maximum and first
        # index: one float (or int) per token each.
        extra = (
            results["split"][phase]["all_reduce"]["forward_calls"]
            - results["whole"][phase]["all_reduce"]["forward_calls"]
        )
        assert extra == 4, (phase, extra)


def step_memory(world_size, measured):
    """`{"split": (peak, largest), "whole": ..., "logits": bytes}`: one
    training step's tensors on this device, `measured(step)` (the backend's
    measure of what `step()` creates), with the accuracy metric (the
    logits stay split) and with top-5 accuracy (they are gathered), on an
    LM whose logits are its largest tensors (a 4,096-token vocabulary,
    width 16)."""
    vocab, length = 4096, 8
    x, y = models.data_for("transformer_lm", batch=BATCH)
    y = (y * 61) % vocab  # targets all over the vocabulary
    metrics = {
        "split": "accuracy",
        "whole": keras.metrics.SparseTopKCategoricalAccuracy(5),
    }
    results = {"logits": BATCH * length * vocab * 4}
    for name, metric in metrics.items():
        tp = keras_tp.TensorParallelKeras(
            models.transformer_lm(vocab=vocab), world_size=world_size
        )
        tp.compile(optimizer="sgd", loss=models.loss_fn(), metrics=[metric])
        tp.train_on_batch(x, y)
        results[name] = measured(lambda: tp.train_on_batch(x, y))
    return results


def check_step_memory(results, world_size):
    """Split logits: no tensor of the step is as large as the whole
    logits, and the step's peak is lower by at least the logits' bytes
    that the gather makes (the gathered logits and their gradient on
    this device, less its own share)."""
    split_peak, split_largest = results["split"]
    whole_peak, whole_largest = results["whole"]
    logits = results["logits"]
    assert whole_largest == logits, results
    assert split_largest == logits // world_size, results
    assert whole_peak - split_peak >= logits - logits // world_size, results
