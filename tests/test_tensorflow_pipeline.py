"""`TensorParallelKeras(pipeline_parallel=P)` on TensorFlow, logical CPUs.

Run alone:
`KERAS_BACKEND=tensorflow python -m pytest tests/test_tensorflow_pipeline.py`.
Each stage is a `tf.distribute` runtime of its own: its variables and
Adam slots live on the stage's devices, and Keras' traced steps run the
micro-batches through the stages as replica steps, next to the same
model on one device. With replicas of the pipeline, each stage's
replicas hold copies of its variables and all-reduce its gradients.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import pytest  # noqa: E402

if keras.backend.backend() != "tensorflow":
    pytest.skip(
        "TensorFlow tests; run with KERAS_BACKEND=tensorflow",
        allow_module_level=True,
    )

import collections  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_tp  # noqa: E402

keras_tp.configure_virtual_devices(4)

from keras_tp.runtime.tensorflow.devices import device_name  # noqa: E402
from tests import checkpoint_cases  # noqa: E402
from tests import models  # noqa: E402
from tests import pipeline_cases  # noqa: E402
from tests import zoo  # noqa: E402
from tests.pipeline_cases import BATCH  # noqa: E402
from tests.pipeline_cases import MICROBATCHES  # noqa: E402

DEVICES = ["cpu:0", "cpu:1"]


def _pipelined(model, world_size=2, **kwargs):
    return keras_tp.TensorParallelKeras(
        model, world_size=world_size, pipeline_parallel=2, **kwargs
    )


def _device(variable):
    """The device TensorFlow stores a Keras variable on, as `cpu:1`."""
    return device_name(variable.value.device)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_fit_evaluate_predict_match_one_device(schedule):
    tp = pipeline_cases.check_mlp_pipeline(schedule)
    trained = {action.microbatch for action in tp._runtime.trained_order}
    assert trained == set(range(MICROBATCHES))
    # Timed by the step itself: when TensorFlow's executor ran each action.
    pipeline_cases.check_measured_timeline(
        tp.pipeline_timeline(), schedule, MICROBATCHES
    )
    # Each device stores its stage's weights, as TensorFlow placed them,
    # and each Adam slot lives with its variable, in its stage's optimizer.
    stage_bytes = pipeline_cases.mlp_stage_bytes()
    assert tp.parameter_bytes_per_device() == dict(zip(DEVICES, stage_bytes))
    stage_of = {"up": 0, "down": 1, "head": 1}
    for variable in tp.model.variables:
        stage = stage_of[variable.path.split("/")[0]]
        assert _device(variable) == DEVICES[stage], variable.path
        prefix = variable.path.replace("/", "_")
        optimizer = tp._runtime.stage_optimizers[stage].optimizer
        slots = [
            v
            for v in optimizer.variables
            if v.name in (f"{prefix}_momentum", f"{prefix}_velocity")
        ]
        assert [_device(v) for v in slots] == [DEVICES[stage]] * 2


def test_training_traces_the_step_once():
    # A variable made while Keras traces the first step (a stage's copy
    # of the optimizer, the step's timings, a metric's total) makes
    # TensorFlow trace the whole pipeline a second time.
    tp = _pipelined(models.mlp(), num_microbatches=MICROBATCHES)
    tp.compile(optimizer="adam", loss=models.loss_fn(), metrics=["accuracy"])
    traced = []
    train_step = tp._runtime.train_step
    tp._runtime.train_step = lambda data: traced.append(1) or train_step(data)
    x, y = models.data_for("mlp", batch=4 * BATCH)
    tp.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    assert len(traced) == 1


def test_a_keras_hub_backbone_carries_its_padding_mask():
    """GPT2's blocks all read the padding mask: stage 0 passes it on, as
    an integer tensor without a gradient. On 2 replicas: the second runs
    keras-hub's layers on its copies of the stages' variables."""
    tp, _, _ = pipeline_cases.check_backbone_pipeline(
        _pipelined(
            models.gpt2_backbone(length=pipeline_cases.LENGTH),
            world_size=4,
            data_parallel=2,
            num_microbatches=MICROBATCHES,
        ),
        pipeline_cases.dense_adam,
    )
    # The second replica's devices hold copies of the first's stages, and
    # each stage's replicas all-reduce its gradients once a step.
    held = list(tp.parameter_bytes_per_device().values())
    assert held[:2] == held[2:]
    data = tp.communication_stats(axis="data")
    assert list(data) == ["all_reduce"]
    assert data["all_reduce"]["bytes"] == sum(held[:2])


def test_replicas_of_the_pipeline_match_one_device():
    """2 replicas x 2 stages: each replica trains on its half of every
    batch, its stages on its own devices with its own copies of their
    variables, and the replicas average each stage's gradients."""
    loss, reference, logged, x, y = pipeline_cases.mlp_reference()
    tp = keras_tp.TensorParallelKeras(
        models.mlp(),
        world_size=4,
        pipeline_parallel=2,
        data_parallel=2,
        num_microbatches=2,
        pipeline_cuts=["down"],
    )
    tp.compile(
        optimizer=keras.optimizers.Adam(1e-2),
        loss=loss,
        metrics=["sparse_categorical_accuracy"],
    )
    history = tp.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"][0], logged, rtol=1e-5)
    pipeline_cases.check_unsplit_weights(reference, tp.get_weights())
    # The `data x pipe` grid, row-major: stage s of replica d on cpu:2d+s.
    assert tp._runtime.stage_devices == [["cpu:0", "cpu:2"], ["cpu:1", "cpu:3"]]
    # Every device holds its stage's weights (with their Adam slots, not
    # counted here), each replica a copy.
    up, rest = pipeline_cases.mlp_stage_bytes()
    assert tp.parameter_bytes_per_device() == {
        "cpu:0": up,
        "cpu:1": rest,
        "cpu:2": up,
        "cpu:3": rest,
    }
    # Per step, each stage's replicas all-reduce its gradients in one
    # bucket (DDP's minimum), as every backend's pipeline replicas do.
    data = tp.communication_stats(axis="data")
    assert set(data) == {"all_reduce"}
    combined = data["all_reduce"]
    assert combined["optimizer_bytes"] == combined["bytes"] == up + rest
    assert combined["calls"] == 2
    # Each replica sends its half of the batch across the cut, and back.
    sent = tp.communication_stats(axis="pipe")["send"]
    assert sent["forward_bytes"] == sent["backward_bytes"] == BATCH * 32 * 4
    assert sent["calls"] == 2 * 2 * 2
    expected = reference.predict(x, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(
        tp.predict(x, batch_size=BATCH, verbose=0), expected, atol=1e-5
    )
    evaluated_loss, accuracy = tp.evaluate(x, y, batch_size=BATCH, verbose=0)
    np.testing.assert_allclose(
        evaluated_loss,
        reference.evaluate(x, y, batch_size=BATCH, verbose=0),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        accuracy, np.mean(expected.argmax(-1) == y), rtol=1e-6
    )
    # set_weights reaches every replica: the second predicts the second
    # half of each batch with its copies.
    other = models.mlp(seed=1)
    tp.set_weights(other.get_weights())
    np.testing.assert_allclose(
        tp.predict(x, batch_size=BATCH, verbose=0),
        other.predict(x, batch_size=BATCH, verbose=0),
        atol=1e-5,
    )
    # Each device computes its own stage, in both replicas alike.
    step = tf.function(lambda x, y: tp.train_step((x, y)))
    graph = step.get_concrete_function(x[:BATCH], y[:BATCH]).graph
    matmuls = collections.Counter(
        device_name(op.device)
        for op in graph.get_operations()
        if op.type == "MatMul"
    )
    assert matmuls["cpu:2"] == matmuls["cpu:0"] > 0
    assert matmuls["cpu:3"] == matmuls["cpu:1"] > 0


def test_replicas_draw_dropout_masks_of_their_own():
    """Each replica of a stage draws dropout masks of its own, as the
    replicas of a data-parallel step do: with one micro-batch, 2
    replicas of the pipeline train exactly as 2 data-parallel replicas
    of the unsplit model."""

    def dropout_model():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((16,))
        hidden = keras.layers.Dense(32, name="up")(inputs)
        hidden = keras.layers.Dropout(0.5, name="drop")(hidden)
        hidden = keras.layers.Dense(32, name="down")(hidden)
        return keras.Model(inputs, keras.layers.Dense(8, name="head")(hidden))

    x, y = models.data_for("mlp", batch=16)
    trained = []
    for kwargs in (
        {"pipeline_parallel": 2, "num_microbatches": 1},
        {},
    ):
        tp = keras_tp.TensorParallelKeras(
            dropout_model(),
            world_size=4 if kwargs else 2,
            data_parallel=2,
            **kwargs,
        )
        tp.compile(optimizer=keras.optimizers.SGD(0.1), loss=models.loss_fn())
        tp.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        trained.append(tp.get_weights())
    for pipelined, data_parallel in zip(*trained):
        np.testing.assert_allclose(pipelined, data_parallel, atol=1e-6)
    one_device = dropout_model()
    one_device.compile(
        optimizer=keras.optimizers.SGD(0.1), loss=models.loss_fn()
    )
    one_device.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    # The masks differ from one device's: each replica draws its own.
    assert any(
        np.abs(a - b).max() > 1e-4
        for a, b in zip(trained[0], one_device.get_weights())
    )


def test_refusals_name_the_fix():
    tp = _pipelined(models.mlp())
    with pytest.raises(ValueError, match="jit_compile=False"):
        tp.compile(optimizer="adam", loss=models.loss_fn(), jit_compile=True)
    clipped = keras.optimizers.SGD(
        0.1, global_clipnorm=1.0, gradient_accumulation_steps=2
    )
    with pytest.raises(ValueError, match="Pass one of the two"):
        tp.compile(optimizer=clipped, loss=models.loss_fn())
    tp.compile(optimizer="adam", loss=models.loss_fn())
    x, y = models.data_for("mlp", batch=12)
    # 12 samples in batches of 8: Keras traces the step for any size.
    with pytest.raises(ValueError, match="drop_remainder=True"):
        tp.fit(x, y, batch_size=8, verbose=0)
    replicated = keras_tp.TensorParallelKeras(
        models.mlp(), world_size=4, pipeline_parallel=2, data_parallel=2
    )
    replicated.compile(optimizer="adam", loss=models.loss_fn())
    with pytest.raises(ValueError, match="divides by 2"):
        replicated.fit(x[:3], y[:3], batch_size=3, verbose=0)


@pytest.mark.parametrize("data_parallel", [1, 2])
def test_optimizer_averages_and_accumulation_equal_one_devices(data_parallel):
    # Each stage's copy of the optimizer averages (use_ema) and
    # accumulates (gradient_accumulation_steps) its own weights through a
    # CoordinatedOptimizer; Keras' end of fit() writes every stage's
    # averages. With replicas, each device its ZeRO-1 partition.
    pipeline_cases.check_averages_and_accumulation(data_parallel)


@pytest.mark.parametrize("world_size", [2, 4])
def test_norm_clips_per_variable_match_one_device(world_size):
    # With 2 tensor-parallel replicas a stage, its optimizer takes each
    # variable's norm over their shards (a CoordinatedOptimizer).
    tp = _pipelined(models.mlp(), world_size=world_size)
    difference = pipeline_cases.whole_variable_updates_difference(
        tp, pipeline_cases.sgd_clipped
    )
    assert difference <= 1e-6


def test_a_causal_lm_shares_its_tied_embedding_between_stages():
    """keras-hub's GPT2 CausalLM computes its logits with its token
    embedding: the last stage's device holds a copy of it, refreshed from
    the first stage's once a step, and its gradient crosses back once a
    step, to be added to the first stage's before the update."""
    microbatches = 2
    tp, shared_bytes = pipeline_cases.causal_lm_pipeline(
        lambda model: _pipelined(model, num_microbatches=microbatches)
    )
    pipeline_cases.check_causal_lm_traffic(
        tp, microbatches, shared_bytes, copies=1
    )


def test_global_clipnorm_counts_the_tied_embedding_once():
    # Each stage's squared gradient norm goes to the last stage's device,
    # the tied embedding's at its owner only: the losses and the weights
    # after 2 clipped SGD steps are one device's.
    pipeline_cases.causal_lm_pipeline(
        _pipelined,
        optimizer=lambda: keras.optimizers.SGD(0.5, global_clipnorm=0.1),
    )


def test_stages_split_by_tensor_parallelism_share_the_tied_embedding(
    tmp_path,
):
    """GPT2's CausalLM on 2 stages, each split over 2 devices (a
    `tf.distribute` strategy per stage): the last stage's devices hold a
    copy of their shard of the token embedding, refreshed from the first
    stage's once a step, and send their gradients of it back; `save()`
    writes the unsplit model."""
    tp, embedding = pipeline_cases.check_split_causal_lm(1, 2, 0)
    shard = embedding.shape[0] // 2 * embedding.shape[1] * 4
    held = tp._runtime.device_bytes([embedding])
    assert list(held.values()) == [shard] * 4
    # save() writes the unsplit model, each stage's shards put together.
    path = str(tmp_path / "lm.keras")
    tp.save(path)
    x = zoo.gpt2()[1]
    np.testing.assert_allclose(
        keras.saving.load_model(path, compile=False).predict(x, verbose=0),
        tp.predict(x, verbose=0),
        atol=1e-5,
    )


def test_split_stages_run_the_plan_checked_for_replicas():
    """Each replica runs the code between a stage's split layers on its
    own values, so the plan is checked for that: Qwen3's attention
    (grouped-query, with query and key norms) splits exactly, its tied
    embedding shared by the stages."""
    pipeline_cases.check_zoo_lm_pipeline(
        "qwen3",
        lambda model: _pipelined(model, world_size=4, num_microbatches=2),
    )


def test_split_stages_follow_the_compiled_optimizers_learning_rate():
    """The MLP on 2 stages x 2 devices, cut between its Column and Row
    layers: each device of the last stage receives its counterpart's
    half of the activation. Each stage's optimizer takes the compiled
    optimizer's learning rate, which a callback lowers after each
    epoch."""

    class LowerRate(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            optimizer = self.model.optimizer
            optimizer.learning_rate = float(optimizer.learning_rate) / 10

    x, y = models.data_for("mlp", batch=32)
    reference = models.mlp()
    model = models.mlp()
    model.set_weights(reference.get_weights())
    tp = _pipelined(model, world_size=4, num_microbatches=2)
    losses = []
    for each in (reference, tp):
        each.compile(
            optimizer=keras.optimizers.Adam(1e-2), loss=models.loss_fn()
        )
        history = each.fit(
            x,
            y,
            batch_size=8,
            epochs=3,
            shuffle=False,
            verbose=0,
            callbacks=[LowerRate()],
        )
        losses.append(history.history["loss"])
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-5)
    pipeline_cases.check_unsplit_weights(reference, tp.get_weights())
    assert int(tp.optimizer.iterations) == 12
    sent = tp.communication_stats(axis="pipe")["send"]
    # Per micro-batch of 4 samples, 2 halves of `up`'s 32 features.
    assert sent["forward_bytes"] == 2 * 2 * 4 * 16 * 4


def test_split_stages_run_sequence_parallelism():
    """GPT2's backbone on 2 stages x 2 devices with sequence parallelism:
    between its split layers each device holds its half of the sequence
    (each split layer's all-reduce a reduce-scatter, its input an
    all-gather), and the hidden states cross the cut as each device's
    half (`check_backbone_traffic`), which the next stage's device takes
    as its shard again, as their gradients come back."""
    tp, x, y = pipeline_cases.check_backbone_pipeline(
        _pipelined(
            models.gpt2_backbone(length=pipeline_cases.LENGTH),
            world_size=4,
            num_microbatches=2,
            sequence_parallel=True,
        ),
        pipeline_cases.dense_adam,
    )
    collectives = tp.communication_stats(axis="model")
    assert collectives["reduce_scatter"]["forward_calls"] > 0
    assert collectives["all_gather"]["forward_calls"] > 0
    assert collectives["all_reduce"]["forward_calls"] == 0
    # A direct call runs in the stages' replicas, as predict does.
    one_device = models.gpt2_backbone(length=pipeline_cases.LENGTH)
    one_device.set_weights(tp.get_weights())
    batch = next(pipeline_cases.batches(x, y, 1))[0]
    np.testing.assert_allclose(tp(batch), one_device(batch), atol=1e-5)


def test_sharded_checkpoints_of_stages_load_at_any_layout(tmp_path):
    """Each stage's first replica writes its variables (2 replicas of 2
    stages here: the second replica's are copies, not written, and take
    the loaded values); a fresh pipeline and one device load them, and a
    pipeline loads one device's checkpoint."""
    differences, manifest = checkpoint_cases.pipeline_round_trip(
        lambda model: _pipelined(model, world_size=4, data_parallel=2),
        str(tmp_path),
    )
    assert manifest["mesh"]["pipeline_parallel"] == 2
    # The first replica of each stage holds every variable of the stage.
    writers = sorted("-".join(f.split("-")[-2:]) for f in manifest["files"])
    assert writers == [
        "stage0-replica0.safetensors",
        "stage1-replica0.safetensors",
    ], writers
    assert len(differences) == 3


def test_losses_the_layers_add_enter_the_loss_and_gradients():
    # Each replica records the losses its stage's layers add; evaluate()
    # adds them as one device does.
    pipeline_cases.check_added_losses(
        lambda model, microbatches: _pipelined(
            model, num_microbatches=microbatches
        )
    )


def test_a_keras_mask_crosses_the_cut_to_the_loss():
    # evaluate() computes the loss of the whole batch's predictions, with
    # the mask they carry out of the stages' replica steps; training
    # weighs each micro-batch's masked mean by its share of unmasked
    # entries.
    pipeline_cases.check_masked_predictions(
        lambda model, microbatches: _pipelined(
            model, num_microbatches=microbatches
        )
    )


def test_a_loss_scale_overflow_skips_the_step_on_every_stage():
    # mixed_float16: the first batch overflows on the last replica's last
    # micro-batch only; every stage of both replicas skips it, as one
    # device does, and halves its scale. The clip takes the norm of the
    # unscaled gradients.
    result = pipeline_cases.loss_scale_overflow(2, global_clipnorm=0.05)
    pipeline_cases.check_loss_scale_overflow(result)
