"""Run on every rank by `keras_tp.launch` in tests/test_torch_pipeline.py.

Each rank wraps the test models in `TensorParallelKeras(...,
pipeline_parallel=2)` (and, on 4 ranks, `data_parallel=2` replicas of
it, or its 2 stages split over 2 tensor-parallel ranks each), trains
them with Keras' own `fit()`, and compares them with the same model
trained on one device (same seed), which it trains itself. Starting the
ranks is the slow part, so every run of a world size happens in one
launch and returns plain numbers.
"""

import os

import keras
import numpy as np
import torch.distributed as dist

import keras_tp
from keras_tp.demo.models import transformer_lm
from keras_tp.pipeline import bubble_fraction
from keras_tp.pipeline import peak_activations
from keras_tp.runtime.torch.storage import parameter_of
from tests import checkpoint_cases
from tests import models
from tests import pipeline_cases
from tests import zoo_cases
from tests.pipeline_cases import BATCH
from tests.pipeline_cases import MICROBATCHES

STAGES = 2
REPLICAS = 2
# Tensor-parallel ranks of each stage in the 4-rank `tensor_parallel_run`.
TENSOR_PARALLEL = 2
# Micro-batches of each replica's half of a batch.
REPLICA_MICROBATCHES = 2


def all_runs(directory):
    """`mlp_run` of each schedule, next to one device's `reference`,
    `backbone_run`, `causal_lm_run`, `masked_run`, `added_run`,
    `optimizer_state_run`, `refusals` and `resumed_run`;
    every rank's results.

    Args:
        directory: where the gpipe run saves its model, and
            `resumed_run` its backups.
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
        "tensor_parallel_backbone": tensor_parallel_backbone_run(),
        "causal_lm": causal_lm_run(),
        "causal_lm_clipped": causal_lm_clipped_run(),
        "masked": masked_run(),
        "added": added_run(),
        "optimizer_state": optimizer_state_run(),
        "refusals": refusals(loss),
        "resumed": resumed_run(os.path.join(directory, "backup")),
    }


def resumed_run(directory):
    """`checkpoint_cases.backup_and_restore_run` of a 2-stage transformer
    LM with dropout: the losses of the uninterrupted and resumed runs."""

    def make(seed):
        return keras_tp.TensorParallelKeras(
            transformer_lm(
                seed=seed, blocks=2, dropout=checkpoint_cases.DROPOUT
            ),
            pipeline_parallel=STAGES,
        )

    return checkpoint_cases.backup_and_restore_run(make, directory)


def causal_lm_run():
    """Trains keras-hub's GPT2 CausalLM on 2 stages, which both call its
    token embedding (`pipeline_cases.causal_lm_pipeline` checks the
    weights against one device's); every rank's results."""
    tp, shared_bytes = pipeline_cases.causal_lm_pipeline(
        lambda model: keras_tp.TensorParallelKeras(
            model,
            world_size=STAGES,
            pipeline_parallel=STAGES,
            num_microbatches=MICROBATCHES // 2,
        )
    )
    (parameter_bytes,) = tp.parameter_bytes_per_device().values()
    return _gathered(
        {
            "pipe": tp.communication_stats(axis="pipe"),
            "shared_bytes": shared_bytes,
            "parameter_bytes": parameter_bytes,
            "total_bytes": tp.get_parallelism_info()["parameter_bytes_total"],
        }
    )


def causal_lm_clipped_run():
    """`causal_lm_run` with SGD clipped by the norm of every stage's
    gradients, the shared embedding's counted once (`global_clipnorm`,
    active at these gradients); `pipeline_cases.causal_lm_pipeline`
    checks the losses and weights against one device's."""
    pipeline_cases.causal_lm_pipeline(
        lambda model: keras_tp.TensorParallelKeras(
            model, world_size=STAGES, pipeline_parallel=STAGES
        ),
        optimizer=lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.1),
    )
    return _gathered(True)


def masked_run(data_parallel=1):
    """`pipeline_cases.check_masked_predictions` on 2 stages of
    `data_parallel` replicas (it asserts evaluate(), the loss and the
    weights): whether each rank got through it."""
    pipeline_cases.check_masked_predictions(
        pipeline_cases.two_stages(data_parallel)
    )
    return _gathered(True)


def optimizer_state_run(data_parallel=1):
    """`pipeline_cases.weight_averages_difference` and
    `accumulated_gradients_difference` (also under a loss scale) on 2
    stages of `data_parallel` replicas (with ZeRO-1)."""
    tp_of = pipeline_cases.two_stages(
        data_parallel, zero_stage=int(data_parallel > 1)
    )
    averaged = pipeline_cases.weight_averages_difference(tp_of(models.mlp()))
    accumulated, loss_scaled = (
        pipeline_cases.accumulated_gradients_difference(tp_of(models.mlp()), s)
        for s in (False, True)
    )
    states = pipeline_cases.state_differences(tp_of, data_parallel)
    return _gathered(
        {
            "averaged": averaged,
            "accumulated": accumulated,
            "loss_scaled": loss_scaled,
            **states,
        }
    )


def added_run(data_parallel=1):
    """`pipeline_cases.check_added_losses` on 2 stages of `data_parallel`
    replicas (it asserts evaluate(), the losses and the weights): whether
    each rank got through it."""
    pipeline_cases.check_added_losses(pipeline_cases.two_stages(data_parallel))
    return _gathered(True)


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
    return _largest_difference(model.get_weights(), weights)


def _largest_difference(arrays, expected):
    """Largest difference between two lists of arrays."""
    return max(
        float(np.max(np.abs(ours - theirs)))
        for ours, theirs in zip(arrays, expected, strict=True)
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
    result["peak"] = peak_activations(tp._runtime.trained_order)
    timeline = tp.pipeline_timeline()
    result["timeline"] = [
        [(span.action.kind, span.start, span.end) for span in spans]
        for spans in timeline.spans
    ]
    result["bubble"] = bubble_fraction(timeline)
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


def tensor_parallel_backbone_run():
    """GPT2's backbone split by tensor parallelism alone, on 2 ranks: the
    model-axis all-reduces of one training step and the bytes each rank
    holds, which the pipeline of tensor-parallel stages must match."""
    x, y = models.backbone_data(BATCH, pipeline_cases.LENGTH)
    tp = keras_tp.TensorParallelKeras(
        models.gpt2_backbone(length=pipeline_cases.LENGTH), world_size=2
    )
    tp.compile(optimizer="adam", loss="mse")
    tp.fit(x, y, batch_size=BATCH, verbose=0)
    return _gathered(
        {
            "all_reduce": tp.communication_stats(axis="model")["all_reduce"],
            "parameter_bytes": tp.parameter_bytes_per_device(),
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


def replicated_run(zero_stage=0):
    """Trains, evaluates and predicts with the MLP on 2 replicas of 2
    stages (1F1B), next to one device; every rank's results.

    Each rank asserts that the unsplit weights equal one device's.

    Args:
        zero_stage: 0 (DDP over the replicas) or 1 (ZeRO-1).
    """
    loss, reference, logged, x, y = pipeline_cases.mlp_reference()
    tp = keras_tp.TensorParallelKeras(
        models.mlp(),
        world_size=STAGES * REPLICAS,
        pipeline_parallel=STAGES,
        data_parallel=REPLICAS,
        zero_stage=zero_stage,
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
        "parameter_bytes": tp.parameter_bytes_per_device(),
        "optimizer_bytes": tp.optimizer_bytes_per_device(),
        **_inference_against(reference, tp, x, y),
    }
    result["predict_gathered"] = tp.communication_stats("predict", axis="data")
    if zero_stage:
        result["train_on_batch_error"] = _one_batch_error(
            loss, x[:BATCH], y[:BATCH], zero_stage
        )
        return _gathered(result)
    result["global_clipnorm_error"] = (
        pipeline_cases.whole_variable_updates_difference(
            keras_tp.TensorParallelKeras(
                models.mlp(),
                world_size=STAGES * REPLICAS,
                pipeline_parallel=STAGES,
                data_parallel=REPLICAS,
            ),
            pipeline_cases.global_clipped,
        )
    )
    try:
        keras_tp.TensorParallelKeras(
            models.mlp(),
            world_size=STAGES * REPLICAS,
            pipeline_parallel=STAGES,
            data_parallel=REPLICAS,
            zero_stage=2,
        )
    except ValueError as e:
        result["zero_refused"] = str(e)
    try:
        tp.evaluate(x[:3], y[:3], verbose=0)
    except ValueError as e:
        result["odd_batch_refused"] = str(e)
    return _gathered(result)


def _one_batch_error(loss, x, y, zero_stage):
    """The largest difference from one device of the replicated MLP after
    one `train_on_batch` (which builds the optimizer itself)."""
    models_after = []
    for wrap in (False, True):
        model = models.mlp()
        if wrap:
            model = keras_tp.TensorParallelKeras(
                model,
                world_size=STAGES * REPLICAS,
                pipeline_parallel=STAGES,
                data_parallel=REPLICAS,
                zero_stage=zero_stage,
                num_microbatches=REPLICA_MICROBATCHES,
            )
        model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
        model.train_on_batch(x, y)
        models_after.append(model.get_weights())
    return _largest_difference(*reversed(models_after))


def four_rank_runs(directory):
    """`replicated_run` (DDP and ZeRO-1), `tensor_parallel_run`,
    `split_cut_run`, `sequence_parallel_run`, `moe_sequence_parallel_run`,
    checkpoint round trips of 2 tensor-parallel stages and of 2 replicas
    of 2 stages with ZeRO-1, and `masked_run`,
    `added_run`, `optimizer_state_run` and `loss_scale_overflow` of 2
    replicas (with ZeRO-1), in one launch of 4 ranks; every rank's results
    of each.

    Args:
        directory: where `tensor_parallel_run` saves its model and the
            round trip its checkpoints.
    """
    return {
        "replicas": replicated_run(),
        "replicas_zero": replicated_run(zero_stage=1),
        "tensor_parallel": tensor_parallel_run(
            os.path.join(directory, "backbone.keras")
        ),
        "split_cut": split_cut_run(),
        "sequence_parallel": sequence_parallel_run(),
        "moe_sequence_parallel": moe_sequence_parallel_run(),
        "checkpoint": checkpoint_cases.pipeline_round_trip(
            lambda model: keras_tp.TensorParallelKeras(
                model, world_size=4, pipeline_parallel=STAGES
            ),
            os.path.join(directory, "checkpoints"),
            dist.get_rank(),
        ),
        "replicas_checkpoint": checkpoint_cases.pipeline_round_trip(
            lambda model: keras_tp.TensorParallelKeras(
                model,
                world_size=STAGES * REPLICAS,
                pipeline_parallel=STAGES,
                data_parallel=REPLICAS,
                zero_stage=1,
            ),
            os.path.join(directory, "replicas_checkpoints"),
            dist.get_rank(),
        ),
        "replicas_masked": masked_run(data_parallel=REPLICAS),
        "replicas_added": added_run(data_parallel=REPLICAS),
        "replicas_optimizer_state": optimizer_state_run(REPLICAS),
        "replicas_loss_scale": _gathered(
            pipeline_cases.loss_scale_overflow(REPLICAS, global_clipnorm=0.05)
        ),
    }


def _trained_backbone(**options):
    """GPT2's backbone on 2 stages (1F1B), each split over 2
    tensor-parallel ranks, with `options`, trained next to one device:
    `(reference, tp, history, x, y)`. Each rank asserts that the unsplit
    weights equal one device's."""
    loss, reference, _, x, y = pipeline_cases.backbone_reference()
    tp = keras_tp.TensorParallelKeras(
        models.gpt2_backbone(length=pipeline_cases.LENGTH),
        world_size=STAGES * TENSOR_PARALLEL,
        pipeline_parallel=STAGES,
        num_microbatches=MICROBATCHES,
        **options,
    )
    tp.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    history = tp.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    pipeline_cases.check_unsplit_weights(reference, tp.get_weights())
    return reference, tp, history, x, y


def sequence_parallel_run():
    """`tensor_parallel_run`'s training with sequence parallelism inside
    the stages: every rank's collectives."""
    reference, tp, _, _, _ = _trained_backbone(sequence_parallel=True)
    weights = tp.get_weights()
    return _gathered(
        {
            "weights_error": _largest_difference(
                weights, reference.get_weights()
            ),
            "model": tp.communication_stats(axis="model"),
            "pipe": tp.communication_stats(axis="pipe"),
        }
    )


def moe_sequence_parallel_run():
    """Mixtral, whose routers add a load-balancing loss, on 2 stages of 2
    tensor-parallel ranks with sequence parallelism, 2 SGD steps next to
    one device: every rank's largest weight difference."""
    reference, tp = zoo_cases.trained(
        "mixtral",
        STAGES * TENSOR_PARALLEL,
        pipeline_parallel=STAGES,
        num_microbatches=1,
        sequence_parallel=True,
    )
    weights = tp.get_weights()
    return _gathered(_largest_difference(weights, reference.get_weights()))


def tensor_parallel_run(path):
    """Trains GPT2's backbone on 2 stages (1F1B), each split over 2
    tensor-parallel ranks: rank `r` holds shard `r % 2` of stage `r // 2`.
    Then evaluates, predicts with and saves it, next to one device; every
    rank's results.

    Each rank asserts that the unsplit weights equal one device's.

    Args:
        path: where to save the model.
    """
    reference, tp, history, x, y = _trained_backbone()
    weights = tp.get_weights()
    expected = reference.get_weights()
    held, stage = _stage_paths(tp)
    result = {
        "weights_error": _largest_difference(weights, expected),
        "logged": history.history["loss"],
        "model": tp.communication_stats(axis="model"),
        "data": tp.communication_stats(axis="data"),
        "pipe": tp.communication_stats(axis="pipe"),
        "parameter_bytes": tp.parameter_bytes_per_device(),
        "optimizer_bytes": tp.optimizer_bytes_per_device(),
        "held": sorted(held),
        "stage": sorted(stage),
        **_inference_against(reference, tp, x, y),
    }
    first_batch, _ = next(pipeline_cases.batches(x, y, 1))
    called = keras.ops.convert_to_numpy(tp(first_batch))
    result["call_error"] = float(
        np.max(np.abs(called - reference.predict(first_batch, verbose=0)))
    )
    tp.save(path)
    saved = keras.saving.load_model(path, compile=False)
    result["saved_error"] = _weights_error(saved, expected)
    # The trained weights differ from one device's by float noise: set
    # exactly, they read back exactly.
    tp.set_weights(expected)
    result["set_error"] = _weights_error(tp, expected)
    try:
        keras_tp.TensorParallelKeras(
            models.mlp(),
            world_size=STAGES * TENSOR_PARALLEL,
            pipeline_parallel=3,
        )
    except ValueError as e:
        result["indivisible_refused"] = str(e)
    for name, optimizer in (
        ("clipnorm_error", pipeline_cases.sgd_clipped),
        ("global_clipnorm_error", pipeline_cases.global_clipped),
    ):
        result[name] = pipeline_cases.whole_variable_updates_difference(
            keras_tp.TensorParallelKeras(
                models.mlp(),
                world_size=STAGES * TENSOR_PARALLEL,
                pipeline_parallel=STAGES,
            ),
            optimizer,
        )
    return _gathered(result)


def split_cut_run():
    """Trains the MLP on 2 stages cut at `down` (1F1B), each split over 2
    tensor-parallel ranks, next to one device; every rank's results.

    `up` is split by its output features (Column) and `down` by its input
    features (Row): `up`'s output crosses the cut split, each rank sending
    its own shard.
    """
    loss, reference, logged, x, y = pipeline_cases.mlp_reference()
    tp = keras_tp.TensorParallelKeras(
        models.mlp(),
        world_size=STAGES * TENSOR_PARALLEL,
        pipeline_parallel=STAGES,
        num_microbatches=MICROBATCHES,
        pipeline_cuts=["down"],
    )
    tp.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    history = tp.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return _gathered(
        {
            "reference_logged": logged,
            "logged": history.history["loss"][0],
            "weights_error": _weights_error(tp, reference.get_weights()),
            "styles": {
                entry.layer.path: repr(entry.style)
                for entry in tp.sharding_plan.layers
            },
            "sent": tp.communication_stats(axis="pipe")["send"],
        }
    )


def _inference_against(reference, tp, x, y):
    """`evaluate` of both models, and the largest `predict` difference."""
    results = {
        "evaluated": tp.evaluate(x, y, batch_size=BATCH, verbose=0),
        "reference_evaluated": reference.evaluate(
            x, y, batch_size=BATCH, verbose=0
        ),
    }
    predicted = tp.predict(x, batch_size=BATCH, verbose=0)
    results["predict_error"] = float(
        np.max(np.abs(predicted - reference.predict(x, verbose=0)))
    )
    return results
