"""`TensorParallelKeras(pipeline_parallel=P)` on JAX, virtual CPU devices.

Run alone: `KERAS_BACKEND=jax python -m pytest tests/test_jax_pipeline.py`.
Each stage is compiled for its own device and holds its variables and
Adam slots there; `fit`, `evaluate` and `predict` run the micro-batches
through the stages, next to the same model on one device.
"""

import os

import pytest

if os.environ.get("KERAS_BACKEND", "jax") != "jax":
    pytest.skip("JAX tests run with KERAS_BACKEND=jax", allow_module_level=True)
os.environ["KERAS_BACKEND"] = "jax"

import keras_tp  # noqa: E402

keras_tp.configure_virtual_devices(8)

import keras  # noqa: E402

from tests import checkpoint_cases  # noqa: E402
from tests import models  # noqa: E402
from tests import pipeline_cases  # noqa: E402
from tests.pipeline_cases import BATCH  # noqa: E402
from tests.pipeline_cases import MICROBATCHES  # noqa: E402


def _pipelined(model, stages, **kwargs):
    return keras_tp.TensorParallelKeras(
        model, world_size=stages, pipeline_parallel=stages, **kwargs
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_fit_evaluate_predict_match_one_device(schedule):
    tp = pipeline_cases.check_mlp_pipeline(schedule)
    # Stamped by each program on its devices: when each action ran.
    pipeline_cases.check_measured_timeline(
        tp.pipeline_timeline(), schedule, MICROBATCHES
    )
    # Each device holds its stage's weights and their Adam slots, measured
    # from the arrays.
    stage_bytes = pipeline_cases.mlp_stage_bytes()
    assert list(tp.parameter_bytes_per_device().values()) == stage_bytes
    slots = tp.optimizer.variables[2:]
    slot_bytes = tp._runtime.device_bytes(slots)
    assert list(slot_bytes.values()) == [2 * b for b in stage_bytes]
    lines = []
    tp.summary(print_fn=lines.append)
    assert lines[0].startswith("Pipeline stages of 'mlp': 2 stages")
    # Compiled again, the stages update with the new optimizer: SGD with
    # a learning rate of 0 leaves every weight as it is.
    trained = tp.get_weights()
    tp.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x, y = models.data_for("mlp", batch=BATCH)
    tp.fit(x, keras.ops.one_hot(y, 8), batch_size=BATCH, verbose=0)
    pipeline_cases.check_unsplit_weights_equal(trained, tp.get_weights())


def test_a_keras_hub_backbone_in_four_stages():
    """GPT2's blocks all read the padding mask: each stage passes it on,
    as an integer tensor without a gradient."""
    pipeline_cases.check_backbone_pipeline(
        _pipelined(
            models.gpt2_backbone(length=pipeline_cases.LENGTH),
            4,
            num_microbatches=MICROBATCHES,
        )
    )


def test_stages_split_by_tensor_parallelism():
    """2 stages x 2 tensor-parallel devices: each stage's layers are split
    as on a tensor-parallel model of 2 devices, whose collectives each
    micro-batch repeats on its stage's devices."""
    tp, x, y = pipeline_cases.check_backbone_pipeline(
        keras_tp.TensorParallelKeras(
            models.gpt2_backbone(length=pipeline_cases.LENGTH),
            world_size=4,
            pipeline_parallel=2,
            num_microbatches=MICROBATCHES,
        )
    )
    tensor_parallel = keras_tp.TensorParallelKeras(
        models.gpt2_backbone(length=pipeline_cases.LENGTH), world_size=2
    )
    tensor_parallel.compile(optimizer="adam", loss="mse")
    first_batch = next(pipeline_cases.batches(x, y, 1))
    tensor_parallel.fit(*first_batch, batch_size=BATCH, verbose=0)
    expected = tensor_parallel.communication_stats(axis="model")["all_reduce"]
    counted = tp.communication_stats(axis="model")["all_reduce"]
    for direction in ("forward", "backward"):
        assert counted[f"{direction}_bytes"] == expected[f"{direction}_bytes"]
        assert counted[f"{direction}_calls"] == (
            MICROBATCHES * expected[f"{direction}_calls"]
        )
    # The two devices of a stage hold its weights split as tensor
    # parallelism splits them, and no device holds another stage's.
    per_device = list(tp.parameter_bytes_per_device().values())
    assert per_device[0] == per_device[1] and per_device[2] == per_device[3]
    assert sum(per_device) == sum(
        tensor_parallel.parameter_bytes_per_device().values()
    )


def test_sequence_parallel_inside_the_stages():
    """2 stages x 2 devices with sequence parallelism: the same weights,
    the stages' all-reduces become reduce-scatters and all-gathers, and
    the hidden states cross each cut as sequence shards, each device
    sending its own half (the integer mask goes whole to each)."""
    loss, reference, split, x, y = pipeline_cases.backbone_reference()
    tp = keras_tp.TensorParallelKeras(
        models.gpt2_backbone(length=pipeline_cases.LENGTH),
        world_size=4,
        pipeline_parallel=2,
        num_microbatches=MICROBATCHES,
        sequence_parallel=True,
    )
    tp.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    tp.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    pipeline_cases.check_unsplit_weights(reference, tp.get_weights())
    assert sorted(tp.communication_stats(axis="model")) == [
        "all_gather",
        "reduce_scatter",
    ]
    sent = tp.communication_stats(axis="pipe")["send"]
    micro = BATCH // MICROBATCHES
    hidden = micro * pipeline_cases.LENGTH * 16 * 4
    mask = micro * pipeline_cases.LENGTH * 4
    assert sent["forward_bytes"] == MICROBATCHES * (hidden + 2 * mask)
    assert sent["backward_bytes"] == MICROBATCHES * hidden


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_replicas_of_stages_split_by_tensor_parallelism(zero_stage):
    """data x pipe x model, 2 x 2 x 2 on 8 devices: see
    `pipeline_cases.check_split_stage_replicas`."""
    tp = pipeline_cases.check_split_stage_replicas(zero_stage)
    # Each stage's programs, on its 4 devices, stamp when they ran.
    pipeline_cases.check_measured_timeline(
        tp.pipeline_timeline(), "1f1b", MICROBATCHES
    )


def test_refusals_name_the_fix():
    replicated = keras_tp.TensorParallelKeras(
        models.mlp(), world_size=4, pipeline_parallel=2, data_parallel=2
    )
    replicated.compile(optimizer="adam", loss=models.loss_fn())
    with pytest.raises(ValueError, match="divides by 2"):
        replicated.fit(*models.data_for("mlp", batch=3), verbose=0)
    with pytest.raises(ValueError, match="not a CoordinatedOptimizer"):
        replicated.compile(
            optimizer=keras_tp.CoordinatedOptimizer(keras.optimizers.Adam()),
            loss=models.loss_fn(),
        )
    with pytest.raises(ValueError, match="there is one"):
        _pipelined(models.mlp(), 2, zero_stage=1)
    with pytest.raises(ValueError, match="Pass zero_stage=1, which partitions"):
        keras_tp.TensorParallelKeras(
            models.mlp(),
            world_size=4,
            pipeline_parallel=2,
            data_parallel=2,
            zero_stage=2,
        )
    with pytest.raises(ValueError, match="No training step has run yet"):
        replicated.pipeline_timeline()
    with pytest.raises(ValueError, match="pass pipeline_parallel > 1"):
        keras_tp.TensorParallelKeras(
            models.mlp(), world_size=2
        ).pipeline_timeline()
    with pytest.raises(ValueError, match="trainable BatchNormalization"):
        _pipelined(models.cnn(), 2)
    tp = _pipelined(models.mlp(), 2)
    with pytest.raises(ValueError, match="reduction='sum_over_batch_size'"):
        tp.compile(
            optimizer="adam",
            loss=keras.losses.SparseCategoricalCrossentropy(reduction="sum"),
        )

    def mean_square(y_true, y_pred):
        # A loss of one's own: a pipeline cannot know it is per sample.
        return keras.ops.mean(keras.ops.square(y_pred), axis=-1)

    with pytest.warns(
        UserWarning, match="Loss 'mean_square' is not one of Keras'"
    ):
        tp.compile(optimizer="adam", loss=mean_square)
    x, y = models.data_for("mlp", batch=8)
    tp.compile(optimizer="adam", loss=models.loss_fn())
    with pytest.raises(ValueError, match="num_microbatches=3 equal"):
        _pipelined(models.mlp(), 2, num_microbatches=3).predict(
            x, batch_size=8, verbose=0
        )


@pytest.mark.parametrize(
    "data_parallel, tensor_parallel, zero_stage", [(1, 2, 0), (2, 2, 1)]
)
def test_a_causal_lm_shares_its_tied_embedding_between_stages(
    data_parallel, tensor_parallel, zero_stage
):
    """keras-hub's GPT2 CausalLM computes its logits with its token
    embedding, which lives on the first stage's devices: the last stage
    receives a copy once a step and sends its gradient back, which the
    first stage adds to its own before the update. Split by tensor
    parallelism, each device exchanges its shard with its counterpart,
    and each replica its own copy."""
    tp, embedding = pipeline_cases.check_split_causal_lm(
        data_parallel, tensor_parallel, zero_stage
    )
    # The owner's devices hold it: one shard per device of the first stage.
    shards = embedding.value.addressable_shards
    assert len({s.device for s in shards}) == data_parallel * tensor_parallel
    assert {s.data.shape[0] for s in shards} == {
        embedding.shape[0] // tensor_parallel
    }


def test_a_routers_added_loss_trains_like_one_device():
    """Mixtral's routers add their load-balancing loss in `call`; with one
    micro-batch each stage's passes add it as one device does."""
    pipeline_cases.check_zoo_lm_pipeline(
        "mixtral",
        lambda model: keras_tp.TensorParallelKeras(
            model, world_size=2, pipeline_parallel=2, num_microbatches=1
        ),
    )


def test_replicated_split_stages_run_the_plan_checked_per_rank():
    """With replicas each stage's passes run per device, on its own
    values, so the plan is checked for that: Qwen3's attention
    (grouped-query, with query and key norms) splits exactly on 2 x 2 x 2
    devices, its tied embedding shared by the stages."""
    pipeline_cases.check_zoo_lm_pipeline(
        "qwen3",
        lambda model: keras_tp.TensorParallelKeras(
            model,
            world_size=8,
            pipeline_parallel=2,
            data_parallel=2,
            num_microbatches=2,
        ),
    )


def test_sharded_checkpoints_of_stages_load_at_any_layout(tmp_path):
    """Each stage's devices write their own shards (2 replicas x 2 stages
    x 2-way tensor parallelism, ZeRO-1, here); a fresh pipeline and one
    device load them, and a pipeline loads one device's checkpoint."""
    checkpoint_cases.check_three_dimensional_round_trip(str(tmp_path))


@pytest.mark.parametrize("data_parallel", [1, 2])
def test_optimizer_averages_and_accumulation_equal_one_devices(data_parallel):
    # Each stage's update averages (use_ema) and accumulates the gradients
    # of (gradient_accumulation_steps) its own weights only; with replicas
    # each device its ZeRO-1 partition.
    pipeline_cases.check_averages_and_accumulation(data_parallel)


def _split_stages_with_replicas():
    """The MLP on 2 stages x 2 replicas x 2 tensor-parallel devices, with
    ZeRO-1."""
    return keras_tp.TensorParallelKeras(
        models.mlp(),
        world_size=8,
        pipeline_parallel=2,
        data_parallel=2,
        zero_stage=1,
    )


def test_norms_read_whole_variables_in_split_stages_with_replicas():
    # Each stage's update runs on global arrays, so Lamb's and clipnorm's
    # norms are each whole variable's.
    tp = _split_stages_with_replicas()
    assert pipeline_cases.whole_variable_updates_difference(tp) < 1e-6


def test_global_clipnorm_spans_every_stage():
    # Each stage's squared norm of its replicas' averaged gradient
    # partitions, summed over its devices, goes to the last stage's
    # devices, whose sum's scale comes back to every stage.
    tp = _split_stages_with_replicas()
    difference = pipeline_cases.whole_variable_updates_difference(
        tp, pipeline_cases.global_clipped
    )
    assert difference < 1e-6
    sent = tp.communication_stats("train", axis="pipe")["send"]
    # Two squared norms out, two scales back, each a float on a stage's 4
    # devices.
    assert sent["optimizer_calls"] == 4
    assert sent["optimizer_bytes"] == 4 * 4 * 4
    # GPT2's stages share its token embedding, counted once: the losses
    # and the weights after 2 clipped SGD steps are one device's.
    pipeline_cases.causal_lm_pipeline(
        lambda model: keras_tp.TensorParallelKeras(
            model, world_size=2, pipeline_parallel=2
        ),
        optimizer=lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.1),
    )


def test_global_clipnorm_clips_the_accumulated_gradients():
    # With gradient_accumulation_steps, an update clips the mean of the
    # gradients accumulated since the last by its norm over every stage,
    # as one device does: read from each stage's accumulators, ZeRO-1's
    # partitions with replicas.
    for tp in (_pipelined(models.mlp(), 2), _split_stages_with_replicas()):
        difference = pipeline_cases.whole_variable_updates_difference(
            tp, pipeline_cases.accumulated_and_clipped
        )
        assert difference < 1e-6


@pytest.mark.parametrize("data_parallel", [1, 2])
def test_losses_the_layers_add_enter_the_loss_and_gradients(data_parallel):
    # Each stage's regularizers and add_loss enter its passes, a
    # micro-batch's share each; evaluate() adds them as one device does.
    pipeline_cases.check_added_losses(pipeline_cases.two_stages(data_parallel))


@pytest.mark.parametrize("data_parallel", [1, 2])
def test_a_keras_mask_crosses_the_cut_to_the_loss(data_parallel):
    # evaluate() computes the loss of the whole batch's predictions, with
    # the mask they carry out of the stages' compiled programs; training
    # weighs each micro-batch's (and replica's) masked mean by its share
    # of unmasked entries.
    pipeline_cases.check_masked_predictions(
        pipeline_cases.two_stages(data_parallel)
    )


def test_a_loss_scale_overflow_skips_the_step_on_every_stage():
    # mixed_float16: the first batch overflows on the last replica's last
    # micro-batch only; every stage of both replicas skips it, as one
    # device does, and halves its scale. The clip takes the norm of the
    # unscaled gradients.
    result = pipeline_cases.loss_scale_overflow(2, global_clipnorm=0.05)
    pipeline_cases.check_loss_scale_overflow(result)
