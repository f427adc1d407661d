"""Run on every rank by `keras_tp.launch` in tests/test_torch_pipeline.py.

Each rank wraps the test models in `TensorParallelKeras(...,
pipeline_parallel=2)` (and, on 4 ranks, `data_parallel=2` replicas of
it), trains them with Keras' own `fit()`, and compares them with the same
model trained on one device (same seed), which it trains itself. Starting
the ranks is the slow part, so every run of a world size happens in one
launch and returns plain numbers.
"""

import os

import keras
import numpy as np
import torch.distributed as dist

import keras_tp
from keras_tp.runtime.torch.storage import parameter_of
from tests import models
from tests import pipeline_cases
from tests.pipeline_cases import BATCH
from tests.pipeline_cases import MICROBATCHES

STAGES = 2
REPLICAS = 2
# Micro-batches of each replica's half of a batch.
REPLICA_MICROBATCHES = 2


def all_runs(directory):
    """`mlp_run` of each schedule, next to one device's `reference`,
    `backbone_run` and `refusals`; every rank's results.

    Args:
        directory: where the gpipe run saves its model.
    """
    loss, reference, logged, x, y = pipeline_cases.mlp_reference()
    untrained = models.mlp()
    untrained.compile(loss=loss)
    # The one-device oracle of both schedules, trained once.
    expected = {
        "logged": logged,
        "evaluated_before": untrained.evaluate(x[:BATCH], y[:BATCH], verbose=0),
        "evaluated": reference.evaluate(x, y, verbose=0),
        "predicted": reference.predict(x, verbose=0),
        "weights": reference.get_weights(),
    }
    path = os.path.join(directory, "mlp.keras")
    return {
        "reference": {
            k: expected[k] for k in ("logged", "evaluated_before", "evaluated")
        },
        "gpipe": mlp_run("gpipe", loss, expected, x, y, path),
        "1f1b": mlp_run("1f1b", loss, expected, x, y),
        "backbone": backbone_run(),
        "refusals": refusals(loss),
    }


def _pipelined(model, schedule, loss):
    tp = keras_tp.TensorParallelKeras(
        model,
        world_size=STAGES,
        pipeline_parallel=STAGES,
        num_microbatches=MICROBATCHES,
        schedule=schedule,
    )
    tp.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    return tp


def _weights_error(model, weights):
    """Largest difference of the model's unsplit weights from `weights`."""
    return max(
        float(np.max(np.abs(ours - theirs)))
        for ours, theirs in zip(model.get_weights(), weights, strict=True)
    )


def _stage_paths(tp):
    """Paths of the variables this rank holds in memory, and of its
    stage's variables."""
    runtime = tp._runtime
    held = {
        v.path
        for v in tp.model.variables
        if parameter_of(v).device.type != "meta"
    }
    return held, {v.path for v in runtime.stage_model.variables}


def _gathered(result):
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    return gathered


def mlp_run(schedule, loss, expected, x, y, path=None):
    """Trains, evaluates, predicts with, calls and saves the MLP on 2
    stages.

    Args:
        schedule: `"gpipe"` or `"1f1b"`.
        loss: the loss to compile with.
        expected: the one-device model's `weights` after `fit`, and its
            `predicted` outputs.
        x, y: the data.
        path: where to save the model, if given.
    """
    tp = _pipelined(models.mlp(), schedule, loss)
    # Evaluating first, at fit's batch size, makes fit's first step switch
    # the same torch stages from forward-only to training.
    result = {
        "evaluated_before": tp.evaluate(
            x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0
        )
    }
    history = tp.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    result["logged"] = history.history["loss"][0]
    result["weights_error"] = _weights_error(tp, expected["weights"])
    result["sent"] = tp.communication_stats(axis="pipe")
    result["kinds"] = [kind for kind, *_ in tp._runtime.timeline]
    result["peak"] = tp._runtime.peak_activations
    if path is not None:
        tp.save(path)
        saved = keras.saving.load_model(path, compile=False)
        result["saved_error"] = _weights_error(saved, expected["weights"])
    held, stage = _stage_paths(tp)
    result["held"] = sorted(held)
    result["stage"] = sorted(stage)
    result["parameter_bytes"] = tp.parameter_bytes_per_device()
    result["optimizer_bytes"] = tp.optimizer_bytes_per_device()
    # A batch of another size than fit's, so another micro-batch size.
    result["evaluated"] = tp.evaluate(x, y, verbose=0)
    predicted = tp.predict(x, verbose=0)
    called = keras.ops.convert_to_numpy(tp(x))
    for name, outputs in (("predict", predicted), ("call", called)):
        result[f"{name}_error"] = float(
            np.max(np.abs(outputs - expected["predicted"]))
        )
    return _gathered(result)


def backbone_run():
    """Trains GPT2's backbone on 2 stages (1F1B), its padding mask carried
    to the second."""
    loss, reference, _, x, y = pipeline_cases.backbone_reference()
    tp = _pipelined(
        models.gpt2_backbone(length=pipeline_cases.LENGTH), "1f1b", loss
    )
    history = tp.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return _gathered(
        {
            "weights_error": _weights_error(tp, reference.get_weights()),
            "logged": history.history["loss"][0],
            "sent": tp.communication_stats(axis="pipe"),
        }
    )


def refusals(loss):
    """The messages of the torch pipeline's own refusals; every rank's."""
    messages = {}
    try:
        keras_tp.TensorParallelKeras(
            models.mlp(), world_size=3, pipeline_parallel=3
        )
    except ValueError as e:
        messages["ranks"] = str(e)
    tp = _pipelined(models.mlp(), "1f1b", loss)
    try:
        tp.compile(optimizer="adam", loss=loss, jit_compile=True)
    except ValueError as e:
        messages["jit_compile"] = str(e)
    return _gathered(messages)


def replicated_run():
    """Trains, evaluates and predicts with the MLP on 2 replicas of 2
    stages (1F1B), next to one device; every rank's results.

    Each rank asserts that the unsplit weights equal one device's.
    """
    loss, reference, logged, x, y = pipeline_cases.mlp_reference()
    tp = keras_tp.TensorParallelKeras(
        models.mlp(),
        world_size=STAGES * REPLICAS,
        pipeline_parallel=STAGES,
        data_parallel=REPLICAS,
        num_microbatches=REPLICA_MICROBATCHES,
        schedule="1f1b",
    )
    tp.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    history = tp.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    pipeline_cases.check_unsplit_weights(reference, tp.get_weights())
    result = {
        "reference_logged": logged,
        "logged": history.history["loss"][0],
        "data": tp.communication_stats(axis="data"),
        "pipe": tp.communication_stats(axis="pipe"),
        "evaluated": tp.evaluate(x, y, batch_size=BATCH, verbose=0),
        "reference_evaluated": reference.evaluate(
            x, y, batch_size=BATCH, verbose=0
        ),
    }
    predicted = tp.predict(x, batch_size=BATCH, verbose=0)
    result["predict_error"] = float(
        np.max(np.abs(predicted - reference.predict(x, verbose=0)))
    )
    result["predict_gathered"] = tp.communication_stats("predict", axis="data")
    try:
        keras_tp.TensorParallelKeras(
            models.mlp(),
            world_size=STAGES * REPLICAS,
            pipeline_parallel=STAGES,
            data_parallel=REPLICAS,
            zero_stage=1,
        )
    except ValueError as e:
        result["zero_refused"] = str(e)
    try:
        tp.evaluate(x[:3], y[:3], verbose=0)
    except ValueError as e:
        result["odd_batch_refused"] = str(e)
    return _gathered(result)
