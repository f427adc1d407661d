"""The vocabulary-parallel loss's checks, shared by every backend.

`runs` trains the demo's transformer LM (a `Dense` LM head) on one device
and split, with padding-like sample weights and the accuracy metric, once
with a loss that reads split logits and once with a metric that needs them
whole; it returns plain numbers, so a torch rank can hand them back.
"""

import keras
import numpy as np

import keras_tp
from tests import models
from tests.models import max_diff

BATCH = 8


def adam():
    return keras.optimizers.Adam(1e-2)


def _compile(model, metrics, optimizer):
    model.compile(
        optimizer=optimizer(),
        loss=models.loss_fn(),
        weighted_metrics=metrics,
    )


def _run(world_size, data_parallel, metrics, optimizer):
    x, y = models.data_for("transformer_lm", batch=2 * BATCH)
    weights = (np.random.default_rng(3).random(y.shape) > 0.3).astype("f4")
    reference = models.transformer_lm()
    tp = keras_tp.TensorParallelKeras(
        models.transformer_lm(),
        world_size=world_size,
        data_parallel=data_parallel,
    )
    histories = []
    for model in (reference, tp):
        _compile(model, metrics(), optimizer)
        fit = model.fit(
            x,
            y,
            sample_weight=weights,
            batch_size=BATCH,
            epochs=2,
            shuffle=False,
            verbose=0,
        )
        histories.append(fit.history)
    evaluations = [
        m.evaluate(x, y, sample_weight=weights, batch_size=BATCH, verbose=0)
        for m in (reference, tp)
    ]
    return {
        "head": tp.get_parallelism_info()["vocab_parallel_head"],
        "history": max(
            max_diff(histories[0][k], histories[1][k]) for k in histories[0]
        ),
        "evaluate": max_diff(evaluations[0], evaluations[1]),
        "predict": max_diff(
            [reference.predict(x, verbose=0)], [tp.predict(x, verbose=0)]
        ),
        "train": tp.communication_stats("train", axis="model"),
        "test": tp.communication_stats("test", axis="model"),
    }


def runs(world_size, data_parallel=1, split=True, optimizer=adam):
    """`{"split": ..., "whole": ...}`: the accuracy metric (split logits),
    and top-5 accuracy, which needs the logits whole. Where the backend
    keeps no logits split (`split=False`), both are one run of both
    metrics: the logits are gathered once for the loss and both.
    `optimizer` makes each model's optimizer."""
    top_5 = keras.metrics.SparseTopKCategoricalAccuracy
    if not split:
        both = _run(
            world_size,
            data_parallel,
            lambda: ["accuracy", top_5(5)],
            optimizer,
        )
        return {"split": both, "whole": both}
    return {
        "split": _run(
            world_size, data_parallel, lambda: ["accuracy"], optimizer
        ),
        "whole": _run(world_size, data_parallel, lambda: [top_5(5)], optimizer),
    }


def check_runs(results, split=True):
    """Exact against one device either way; split logits are never
    gathered in training or evaluation, whole ones once per step.

    Args:
        results: `runs`.
        split: whether the backend keeps the logits split.
    """
    for run in results.values():
        assert run["history"] < 1e-5, run
        assert run["evaluate"] < 1e-5, run
        # Logits after 4 Adam steps at 1e-2: float32 rounding of each
        # backend's reductions, as the demo's parity check allows.
        assert run["predict"] < 1e-4, run
    assert results["whole"]["head"] is None
    assert results["split"]["head"] == ("lm_head" if split else None)
    for phase in ("train", "test"):
        split_gathers = results["split"][phase].get("all_gather", {})
        whole_gathers = results["whole"][phase]["all_gather"]
        assert whole_gathers["forward_calls"] == 1, whole_gathers
        if split:
            assert not split_gathers, results["split"][phase]
            # The loss's maximum and sums, the accuracy's maximum and
            # first index: one float (or int) per token each.
            extra = (
                results["split"][phase]["all_reduce"]["forward_calls"]
                - results["whole"][phase]["all_reduce"]["forward_calls"]
            )
            assert extra == 4, (phase, extra)
