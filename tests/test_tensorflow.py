"""Tensor parallelism on the TensorFlow backend, over tf.distribute replicas.

Run in a process of its own (the backend is read when Keras is imported):

    KERAS_BACKEND=tensorflow python -m pytest tests/test_tensorflow.py -q

The module splits the CPU into 4 virtual devices before TensorFlow starts
and picks 2 or 4 of them per model with `world_size`/`device_ids`. The
oracle is the same model on one device.
"""

import functools
import json
import os
import socket
import subprocess
import sys

os.environ.setdefault("KERAS_BACKEND", "tensorflow")

import keras  # noqa: E402
import pytest  # noqa: E402

if keras.backend.backend() != "tensorflow":
    pytest.skip(
        "TensorFlow tests; run with KERAS_BACKEND=tensorflow",
        allow_module_level=True,
    )

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras_tp  # noqa: E402
from keras_tp.runtime.tensorflow import TensorFlowRuntime  # noqa: E402

keras_tp.configure_virtual_devices(4)

from tests import generation_cases  # noqa: E402
from tests import models  # noqa: E402
from tests import output_cases  # noqa: E402
from tests import own_loss_cases  # noqa: E402
from tests import random_cases  # noqa: E402
from tests import regularizer_cases  # noqa: E402
from tests import speaker_cases  # noqa: E402
from tests import vocab_cases  # noqa: E402
from tests import zoo_cases  # noqa: E402
from tests.dp_cases import check_local_sgd_runs  # noqa: E402

TOLERANCE = 1e-5
FIT_STEPS = 5
BATCH = 4
MODELS = ("mlp", "cnn", "transformer_lm", "subclassed")
# The transformer LM and the subclassed model run 2 ways only: their 4-way
# splits cost most of the module's time (TensorFlow traces every replica)
# and test nothing the MLP's and the CNN's 4-way splits and the zoo's
# transformers do not.
CASES = [
    (name, n)
    for name in MODELS
    for n in (2, 4)
    if n == 2 or name in ("mlp", "cnn")
]


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _compile(model, **kwargs):
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=_loss(), **kwargs)


def _max_diff(a, b):
    return max(
        float(np.abs(np.asarray(x) - np.asarray(y)).max()) for x, y in zip(a, b)
    )


def _replica_gradients(tp, x, y):
    """Per-replica gradients of the TP model, each a list over variables.

    The loss is computed on every replica with the functional loss, which
    (unlike a `keras.losses.Loss` object) does not divide by the replicas.
    """
    strategy = tp._runtime.strategy
    variables = tp.trainable_variables

    def replica_step():
        with tf.GradientTape() as tape:
            logits = tp(x, training=True)
            loss = keras.ops.mean(
                keras.losses.sparse_categorical_crossentropy(
                    y, logits, from_logits=True
                )
            )
        return tape.gradient(loss, variables)

    per_replica = tf.function(lambda: strategy.run(replica_step))()
    return [
        [tf.convert_to_tensor(g).numpy() for g in gradients]
        for gradients in strategy.experimental_local_results(per_replica)
    ]


def _reference_gradients(model, x, y):
    with tf.GradientTape() as tape:
        logits = model(x, training=True)
        loss = keras.ops.mean(
            keras.losses.sparse_categorical_crossentropy(
                y, logits, from_logits=True
            )
        )
    return [
        tf.convert_to_tensor(g).numpy()
        for g in tape.gradient(loss, model.trainable_variables)
    ]


def _split_axes(tp):
    """`{variable path: split axis}` of the applied plan."""
    return {
        path: axis
        for path, (_, axis) in tp.sharding_plan.variable_axes().items()
    }


def _components(variable):
    return [c.numpy() for c in variable.value.values]


@functools.lru_cache(maxsize=None)
def run_case(name, n):
    """Builds, checks and trains one model on `n` devices; cached per case."""
    build = models.BUILDERS[name]
    reference, tp_model = build(), build()
    x, y = models.data_for(name, batch=BATCH * FIT_STEPS)
    tp = keras_tp.TensorParallelKeras(tp_model, world_size=n)
    result = {"tp": tp, "reference": reference, "x": x, "y": y}

    result["call_diff"] = _max_diff([tp(x)], [reference(x)])
    if name != "cnn":  # its BatchNormalization reads split variables
        # The wrapped model called itself, outside the replicas: each
        # sharded layer runs as a replica step of its own.
        result["inner_call_diff"] = _max_diff([tp.model(x)], [reference(x)])
    # Gradients on one batch, per replica, before any training.
    batch_x, batch_y = x[:BATCH], y[:BATCH]
    result["replica_gradients"] = _replica_gradients(tp, batch_x, batch_y)
    result["reference_gradients"] = _reference_gradients(
        reference, batch_x, batch_y
    )

    for model in (reference, tp):
        _compile(model, metrics=["accuracy"])
    result["predict_diff"] = _max_diff(
        [tp.predict(x, verbose=0)], [reference.predict(x, verbose=0)]
    )
    for model in (reference, tp):
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0)
    result["weight_diff"] = _max_diff(tp.get_weights(), reference.get_weights())
    result["train_stats"] = tp.communication_stats("train")
    return result


@pytest.mark.parametrize("name,n", CASES)
def test_forward_matches_one_device(name, n):
    case = run_case(name, n)
    assert case["call_diff"] <= TOLERANCE
    assert case.get("inner_call_diff", 0) <= TOLERANCE
    assert case["predict_diff"] <= TOLERANCE


@pytest.mark.parametrize("name,n", CASES)
def test_gradients_match_one_device(name, n):
    case = run_case(name, n)
    axes = _split_axes(case["tp"])
    variables = case["tp"].trainable_variables
    per_replica = case["replica_gradients"]
    assert len(per_replica) == n
    for i, (variable, expected) in enumerate(
        zip(variables, case["reference_gradients"])
    ):
        shards = [gradients[i] for gradients in per_replica]
        axis = axes.get(variable.path)
        # A replicated variable gets the whole gradient on every replica.
        candidates = (
            shards if axis is None else [np.concatenate(shards, axis=axis)]
        )
        for full in candidates:
            np.testing.assert_allclose(
                full, expected, rtol=0, atol=TOLERANCE, err_msg=variable.path
            )


@pytest.mark.parametrize("name,n", CASES)
def test_weights_after_adam_fit_match_one_device(name, n):
    case = run_case(name, n)
    assert case["tp"].optimizer.iterations.numpy() == FIT_STEPS
    assert case["weight_diff"] <= TOLERANCE


@pytest.mark.parametrize("name,n", [("transformer_lm", 2), ("cnn", 4)])
def test_replicated_variables_stay_identical_on_every_replica(name, n):
    tp = run_case(name, n)["tp"]
    variables = tp.model.variables + tp.optimizer.variables
    replicated = [v for v in variables if len(set(_shapes(v))) == 1]
    assert len(replicated) < len(variables)
    for variable in replicated:
        components = _components(variable)
        assert len(components) == n
        for component in components[1:]:
            np.testing.assert_array_equal(
                component, components[0], err_msg=variable.path
            )


def _shapes(variable):
    return [tuple(c.shape) for c in variable.value.values] + [
        tuple(variable.shape)
    ]


@pytest.mark.parametrize("name,n", CASES)
def test_bytes_per_device_within_bound(name, n):
    case = run_case(name, n)
    tp, reference = case["tp"], case["reference"]
    split = _split_axes(tp)
    sharded = replicated = 0
    for variable in reference.variables:
        size = variable.numpy().nbytes
        if variable.path in split:
            sharded += size
        else:
            replicated += size
    parameter_bound = 1.01 * (sharded / n + replicated)
    measured = tp.parameter_bytes_per_device()
    assert len(measured) == n
    assert all(0 < b <= parameter_bound for b in measured.values()), measured

    # Optimizer: Adam keeps two slots per trainable variable, split like it,
    # plus the iteration count and learning rate on every device.
    slot_sharded = 2 * sum(
        v.numpy().nbytes
        for v in reference.trainable_variables
        if v.path in split
    )
    slot_replicated = 2 * sum(
        v.numpy().nbytes
        for v in reference.trainable_variables
        if v.path not in split
    )
    scalars = sum(
        v.numpy().nbytes for v in reference.optimizer.variables if not v.shape
    )
    optimizer_bound = 1.01 * (slot_sharded / n + slot_replicated + scalars)
    optimizer_measured = tp.optimizer_bytes_per_device()
    assert all(0 < b <= optimizer_bound for b in optimizer_measured.values()), (
        optimizer_measured,
        optimizer_bound,
    )


def test_generation_matches_one_device():
    # The cache is filled in a tf.function: eagerly, MirroredStrategy
    # runs each replica step op by op.
    results = generation_cases.runs(2, compiled=tf.function)
    generation_cases.check_runs(results, 2)


def test_vocab_parallel_loss_matches_one_device():
    # Each replica computes its tokens' loss and accuracy from its rows of
    # the vocabulary; 2 rows of 2, so each row's labels are its own.
    # Keras' Adam on one TensorFlow device counts a token seen twice in a
    # batch twice (its embedding's gradient stays `tf.IndexedSlices`),
    # where the data axis sums it first, as on JAX and torch: momentum
    # SGD, linear in the gradient, takes the same steps either way.
    vocab_cases.check_runs(
        vocab_cases.runs(
            4,
            data_parallel=2,
            optimizer=lambda: keras.optimizers.SGD(0.1, momentum=0.9),
        )
    )


def test_a_tensor_returned_twice_trains_as_on_one_device():
    # Its places' gradients counted once (D-FINE's decoder states): split,
    # with a data axis, and in a pipeline's last stage.
    output_cases.check_runs(output_cases.runs(2))
    output_cases.check_runs(output_cases.runs(4, data_parallel=2))
    output_cases.check_runs(output_cases.runs(4, pipeline_parallel=2))


def test_a_models_own_compute_loss_trains_from_the_outputs_only():
    # The loss is computed outside the replicas, from their outputs: a
    # loss of the model's own that reads only them trains as on one
    # device; one that calls the model again is refused in training (no
    # gradient would reach the layers it calls) and exact in evaluation.
    own_loss_cases.check_runs(own_loss_cases.runs(2, calls_again=False))
    refused = own_loss_cases.tensorflow_refusal(2)
    assert "PairedTowers.compute_loss calls layer '" in refused["error"]
    assert "Train this model on JAX or torch" in refused["error"]
    np.testing.assert_allclose(*refused["evaluated"], atol=1e-5)


def test_regularized_split_layers_report_one_devices_loss():
    # Each replica penalises its slices, and adds the losses its layers
    # add (an activity regularizer's) in the replica.
    regularizer_cases.check_runs(regularizer_cases.runs(2))


def test_transformer_collectives_per_step():
    # 2 ways: CASES' transformer LM (see there).
    n = 2
    stats = run_case("transformer_lm", n)["train_stats"]
    blocks = 2
    # Per block 2 forward and 2 backward all-reduces; plus the token and
    # position embeddings (forward) and the lm head's input (backward). Its
    # logits stay split by vocabulary: the loss and the accuracy reduce two
    # numbers per token each (`keras_tp.vocab_parallel`), nothing is
    # gathered.
    assert stats["all_reduce"]["forward_calls"] == 2 * blocks + 2 + 4
    assert stats["all_reduce"]["backward_calls"] == 2 * blocks + 1
    # One broadcast keeps the replicated variables' gradients identical.
    tp = run_case("transformer_lm", n)["tp"]
    split = _split_axes(tp)
    replicated_bytes = sum(
        v.numpy().nbytes
        for v in run_case("transformer_lm", n)["reference"].trainable_variables
        if v.path not in split
    )
    assert (
        stats["broadcast"]["backward_calls"] == stats["broadcast"]["calls"] == 1
    )
    assert stats["broadcast"]["bytes"] == replicated_bytes
    assert set(stats) == {"all_reduce", "broadcast"}
    # Bytes are one rank's buffers: a block's forward all-reduce moves the
    # (batch, seq, dim) activations.
    seq_len, dim = run_case("transformer_lm", n)["x"].shape[1], 16
    activations = BATCH * seq_len * dim * 4
    positions = seq_len * dim * 4  # the position table is looked up once
    # The loss's maximum, then its two sums; the accuracy's maximum, then
    # its first index: 5 numbers of 4 bytes per token.
    loss_and_accuracy = BATCH * seq_len * 5 * 4
    assert (
        stats["all_reduce"]["forward_bytes"]
        == (2 * blocks + 1) * activations + positions + loss_and_accuracy
    )


def test_transformer_block_adds_two_forward_and_two_backward_all_reduces():
    counts = {}
    for blocks in (1, 2):
        model = models.transformer_lm(blocks=blocks)
        tp = keras_tp.TensorParallelKeras(model, world_size=2)
        _compile(tp)
        x, y = models.data_for("transformer_lm", batch=BATCH)
        tp.train_on_batch(x, y)
        stats = tp.communication_stats()["all_reduce"]
        counts[blocks] = (stats["forward_calls"], stats["backward_calls"])
    assert counts[2][0] - counts[1][0] == 2
    assert counts[2][1] - counts[1][1] == 2


def test_gradients_are_not_n_times_too_large():
    """Megatron f/g on TensorFlow: the raw all-reduce gradient is N x."""
    n = 4
    runtime = TensorFlowRuntime(keras_tp.ParallelConfig(world_size=n))
    adapter = runtime.adapter
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 8)).astype("float32")
    up = rng.normal(size=(8, 12)).astype("float32")
    down = rng.normal(size=(12, 5)).astype("float32")
    up_shards = np.split(up, n, axis=1)
    down_shards = np.split(down, n, axis=0)

    def replica_gradients(reduce):
        rank = adapter.rank()
        up_local = tf.constant(np.stack(up_shards))[rank]
        down_local = tf.constant(np.stack(down_shards))[rank]
        inputs = tf.constant(x)
        with tf.GradientTape() as tape:
            tape.watch([inputs, up_local, down_local])
            hidden = tf.tanh(adapter.copy_to_parallel(inputs) @ up_local)
            out = reduce(hidden @ down_local)
            loss = tf.reduce_sum(out**2)
        return tape.gradient(loss, [inputs, up_local, down_local])

    def run(reduce):
        per_replica = tf.function(
            lambda: runtime.strategy.run(lambda: replica_gradients(reduce))
        )()
        results = runtime.strategy.experimental_local_results(per_replica)
        dx = results[0][0].numpy()
        dup = np.concatenate([r[1].numpy() for r in results], axis=1)
        ddown = np.concatenate([r[2].numpy() for r in results], axis=0)
        return dx, dup, ddown

    inputs, kernel_up, kernel_down = (tf.Variable(v) for v in (x, up, down))
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum((tf.tanh(inputs @ kernel_up) @ kernel_down) ** 2)
    expected = [
        g.numpy() for g in tape.gradient(loss, [inputs, kernel_up, kernel_down])
    ]

    with adapter.activated():
        ours = run(adapter.reduce_from_parallel)
        raw = run(
            lambda t: tf.distribute.get_replica_context().all_reduce("sum", t)
        )
    for got, want in zip(ours, expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # TensorFlow's own all-reduce gradient all-reduces again: N times.
    np.testing.assert_allclose(raw[1], n * expected[1], rtol=1e-5, atol=1e-4)


def test_collectives_and_their_gradients():
    n = 4
    runtime = TensorFlowRuntime(keras_tp.ParallelConfig(world_size=n))
    adapter = runtime.adapter
    collectives = keras_tp.collectives

    def replica_step():
        with adapter.activated():
            rank = collectives.rank()
            x = tf.fill([2, 4], float(rank + 1))
            with tf.GradientTape(persistent=True) as tape:
                tape.watch(x)
                gathered = collectives.all_gather(x, axis=1)
                scattered = collectives.reduce_scatter(x, axis=1)
            values = {
                "sum": collectives.all_reduce(x, "sum"),
                "mean": collectives.all_reduce(x, "mean"),
                "max": collectives.all_reduce(x, "max"),
                "min": collectives.all_reduce(x, "min"),
                "gathered": gathered,
                "scattered": scattered,
                "broadcast": collectives.broadcast(x, root=2),
                "rank": tf.constant(rank),
                "size": tf.constant(collectives.size()),
                # Each rank's output slice weighs rank + 1 in a loss summed
                # over ranks: d/dx = sum over ranks of that weight.
                "gather_grad": tape.gradient(
                    gathered,
                    x,
                    output_gradients=tf.fill([2, 4 * n], float(rank + 1)),
                ),
                "scatter_grad": tape.gradient(
                    scattered,
                    x,
                    output_gradients=tf.fill([2, 1], float(rank + 1)),
                ),
            }
        return values

    per_replica = tf.function(lambda: runtime.strategy.run(replica_step))()
    results = runtime.strategy.experimental_local_results(per_replica)
    total = sum(range(1, n + 1))
    for rank, values in enumerate(results):
        values = {k: v.numpy() for k, v in values.items()}
        assert values["rank"] == rank and values["size"] == n
        np.testing.assert_allclose(values["sum"], total)
        np.testing.assert_allclose(values["mean"], total / n)
        np.testing.assert_allclose(values["max"], n)
        np.testing.assert_allclose(values["min"], 1)
        np.testing.assert_allclose(values["broadcast"], 3)
        np.testing.assert_allclose(
            values["gathered"],
            np.repeat(np.arange(1, n + 1), 4)[None].repeat(2, 0),
        )
        np.testing.assert_allclose(values["scattered"], np.full((2, 1), total))
        # all_gather backward = reduce-scatter of the cotangents: rank r's
        # slice of x receives every rank's weight.
        np.testing.assert_allclose(values["gather_grad"], total)
        # reduce_scatter backward = all-gather: slice r of x gets rank r's.
        np.testing.assert_allclose(
            values["scatter_grad"], np.arange(1, n + 1)[None].repeat(2, 0)
        )


def test_the_first_steps_are_traced_once():
    # Keras on TensorFlow builds a model's metrics and its outputs' loss
    # trackers inside its first traced step unless a tf.distribute
    # strategy is set; their variables, made while tracing, would make
    # TensorFlow trace every replica's forward and backward pass a second
    # time. A model of two outputs has a loss tracker per output (the
    # pipeline's trace test compiles with metrics).
    inputs = keras.Input((16,))
    hidden = keras.layers.Dense(32, activation="relu", name="up")(inputs)
    outputs = [keras.layers.Dense(8, name=f"head{i}")(hidden) for i in (0, 1)]
    tp = keras_tp.TensorParallelKeras(
        keras.Model(inputs, outputs), world_size=2
    )
    _compile(tp)
    traced = []
    for phase in ("_train_step", "_test_step"):
        step = getattr(tp._runtime, phase)
        setattr(
            tp._runtime,
            phase,
            lambda model, data, step=step, phase=phase: (
                traced.append(phase) or step(model, data)
            ),
        )
    x, y = models.data_for("mlp", batch=4 * BATCH)
    tp.fit(x, (y, y), batch_size=BATCH, epochs=2, verbose=0)
    logs = tp.evaluate(x, (y, y), batch_size=BATCH, verbose=0, return_dict=True)
    assert traced == ["_train_step", "_test_step"]
    # The outputs' loss trackers exist: what the early build made.
    assert any(name.endswith("_loss") for name in logs)


def test_metrics_are_computed_once():
    case = run_case("mlp", 2)
    tp, reference, x, y = case["tp"], case["reference"], case["x"], case["y"]
    tp_logs = tp.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    reference_logs = reference.evaluate(
        x, y, batch_size=BATCH, verbose=0, return_dict=True
    )
    assert tp_logs == pytest.approx(reference_logs, abs=TOLERANCE)
    # The loss tracker counted each sample once, not once per replica.
    total, count = (v.numpy() for v in tp.metrics[0].variables)
    assert count == len(x)
    assert total == pytest.approx(reference_logs["loss"] * len(x), rel=1e-5)


def test_fit_on_tf_data_matches_fit_on_numpy():
    case = run_case("mlp", 2)
    x, y = case["x"], case["y"]
    tp = keras_tp.TensorParallelKeras(models.mlp(), world_size=2)
    _compile(tp, metrics=["accuracy"])
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    history = tp.fit(dataset, epochs=1, verbose=0)
    assert (
        _max_diff(tp.get_weights(), case["reference"].get_weights())
        <= TOLERANCE
    )
    assert len(history.history["loss"]) == 1


def test_keras_training_loop_features_keep_working():
    tp = keras_tp.TensorParallelKeras(
        models.mlp(), device_ids=["cpu:2", "cpu:3"]
    )
    _compile(tp)
    x, y = models.data_for("mlp", batch=20)
    seen = []
    callback = keras.callbacks.LambdaCallback(
        on_batch_end=lambda batch, logs: seen.append(batch)
    )
    history = tp.fit(
        x,
        y,
        batch_size=4,
        epochs=2,
        validation_split=0.2,
        callbacks=[callback],
        verbose=0,
    )
    assert set(history.history) == {"loss", "val_loss"}
    assert len(seen) == 8
    # One row per sample, not one per replica.
    assert tp.predict(x, batch_size=3, verbose=0).shape == (20, 8)
    assert tp.predict_on_batch(x[:5]).shape == (5, 8)
    assert np.isfinite(tp.test_on_batch(x[:4], y[:4]))
    bytes_per_device = tp.parameter_bytes_per_device()
    assert set(bytes_per_device) == {"cpu:2", "cpu:3"}
    assert all(b > 0 for b in bytes_per_device.values())


def test_get_set_weights_and_save_round_trip(tmp_path):
    case = run_case("transformer_lm", 2)
    tp, x = case["tp"], case["x"]
    trained = tp.get_weights()
    fresh = keras_tp.TensorParallelKeras(
        models.transformer_lm(seed=3), world_size=2
    )
    assert _max_diff(fresh.get_weights(), trained) > 1e-3
    fresh.set_weights(trained)
    assert _max_diff(fresh.get_weights(), trained) == 0
    np.testing.assert_allclose(fresh(x), tp(x), atol=TOLERANCE)

    path = str(tmp_path / "transformer.keras")
    bytes_before = tp.parameter_bytes_per_device()
    tp.save(path)
    loaded = keras.saving.load_model(path)
    assert _max_diff(loaded.get_weights(), trained) == 0
    np.testing.assert_allclose(
        loaded.predict(x, verbose=0), tp.predict(x, verbose=0), atol=TOLERANCE
    )
    # Saving leaves the model split and training.
    assert tp.parameter_bytes_per_device() == bytes_before

    weights_path = str(tmp_path / "transformer.weights.h5")
    tp.save_weights(weights_path)
    plain = models.transformer_lm(seed=3)
    keras_tp.load_checkpoint(plain, weights_path)
    assert _max_diff(plain.get_weights(), trained) == 0
    assert tp.parameter_bytes_per_device() == bytes_before
    tp.train_on_batch(x[:BATCH], case["y"][:BATCH])


def test_split_variables_cannot_be_read_whole_by_mistake():
    tp = run_case("mlp", 2)["tp"]
    kernel = tp.model.get_layer("up").kernel
    with pytest.raises(ValueError):
        kernel.numpy()


def test_configure_virtual_devices_after_start_says_what_to_do():
    keras_tp.configure_virtual_devices(4)  # what TensorFlow already has: fine
    with pytest.raises(
        RuntimeError, match="before any Keras or TensorFlow operation"
    ):
        keras_tp.configure_virtual_devices(3)


def test_run_eagerly_matches_one_device():
    case = run_case("mlp", 2)
    tp = keras_tp.TensorParallelKeras(models.mlp(), world_size=2)
    _compile(tp, run_eagerly=True)
    tp.fit(case["x"], case["y"], batch_size=BATCH, shuffle=False, verbose=0)
    assert (
        _max_diff(tp.get_weights(), case["reference"].get_weights())
        <= TOLERANCE
    )


def test_several_steps_per_execution_are_refused_with_the_fix():
    tp = keras_tp.TensorParallelKeras(models.mlp(), world_size=2)
    tp.compile(optimizer="adam", loss=_loss(), steps_per_execution=2)
    x, y = models.data_for("mlp")
    with pytest.raises(ValueError, match="steps_per_execution=1"):
        tp.fit(x, y, batch_size=4, verbose=0)


def test_jit_compile_is_refused_with_the_fix():
    tp = keras_tp.TensorParallelKeras(models.mlp(), world_size=2)
    tp.compile(optimizer="adam", loss=_loss(), jit_compile=True)
    x, y = models.data_for("mlp")
    with pytest.raises(ValueError, match="jit_compile=False"):
        tp.train_on_batch(x, y)


def test_accumulation_in_a_keras_optimizer_is_refused_with_the_fix():
    # One replica holds whole variables: the optimizer stays Keras' own.
    tp = keras_tp.TensorParallelKeras(models.mlp(), world_size=1)
    accumulating = keras.optimizers.SGD(gradient_accumulation_steps=2)
    tp.compile(optimizer=accumulating, loss=_loss())
    x, y = models.data_for("mlp")
    with pytest.raises(NotImplementedError, match="CoordinatedOptimizer\\("):
        tp.train_on_batch(x, y)


def _free_port():
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def multi_worker(tmp_path_factory):
    """Each worker's results of `tests/tf_scripts/multi_worker.py`, in task
    order, run once for the tests below on two workers on loopback ports:
    the ZeRO stages of `_MULTI_WORKER_STEP` with data_parallel=2."""
    tmp_path = tmp_path_factory.mktemp("multi_worker")
    stages = ",".join(str(stage) for stage in _MULTI_WORKER_STEP)
    script = os.path.join(
        os.path.dirname(__file__), "tf_scripts", "multi_worker.py"
    )
    cluster = {"worker": [f"localhost:{_free_port()}" for _ in range(2)]}
    workers = []
    for index in range(2):
        env = dict(
            os.environ,
            KERAS_BACKEND="tensorflow",
            TF_CONFIG=json.dumps(
                {"cluster": cluster, "task": {"type": "worker", "index": index}}
            ),
        )
        out = tmp_path / f"worker{index}.json"
        log = open(tmp_path / f"worker{index}.log", "w")
        process = subprocess.Popen(
            [sys.executable, script, str(out), stages],
            env=env,
            stdout=log,
            stderr=log,
        )
        workers.append((process, out, log))
    for process, _, log in workers:
        process.wait(timeout=300)
        log.close()
    for index, (process, _, _) in enumerate(workers):
        assert process.returncode == 0, (
            tmp_path / f"worker{index}.log"
        ).read_text()[-3000:]
    return [json.loads(out.read_text()) for _, out, _ in workers]


def _check_checkpoint_round_trip(result, replicas):
    """The checkpoint has a file of each of `replicas`; the split model
    and a plain one read it back exactly."""
    assert result["checkpoint_files"] == [
        f"save1-replica{replica}.safetensors" for replica in replicas
    ]
    assert result["checkpoint_plain_diff"] == 0.0
    assert result["checkpoint_reload_diff"] == 0.0


def test_multi_worker_mirrored_strategy_matches_one_device(multi_worker):
    results = [worker["tensor_parallel"] for worker in multi_worker]
    for result in results:
        assert result["world_size"] == 2
        assert result["weight_diff"] <= TOLERANCE
        assert result["output_diff"] <= TOLERANCE
        # Each worker holds half of the split parameters.
        local = [b for b in result["parameter_bytes_per_device"].values() if b]
        assert len(local) == 1
        _check_checkpoint_round_trip(result, [0, 1])
        # Sequence shards and split logits across the workers: exact,
        # with Megatron's collectives (see the single-host test).
        sequence = result["sequence"]
        zoo_cases.check_sequence_parallel(
            sequence, sequence["whole_weights"], regathered=True
        )
    speaker_cases.check_one_speaker(
        [result["one_speaker"] for result in results]
    )


# Collectives of a training step with data_parallel=2 across two workers,
# each reading its half of every global batch, by ZeRO stage, as
# (forward, backward, optimizer) calls: all-gathers of the rows' outputs
# and of the labels, then the CoordinatedOptimizer's over `data` (ZeRO-3:
# a gather of each of the MLP's 6 weights, and a reduce-scatter of each
# gradient).
_MULTI_WORKER_STEP = {
    0: {"all_gather": (2, 0, 0), "all_reduce": (0, 0, 1)},
    1: {"all_gather": (2, 0, 1), "reduce_scatter": (0, 0, 1)},
    3: {"all_gather": (8, 0, 0), "reduce_scatter": (0, 6, 0)},
}


def test_multi_worker_data_parallel_matches_one_device(multi_worker):
    for result in (worker["data_parallel"] for worker in multi_worker):
        for stage, step in _MULTI_WORKER_STEP.items():
            _check_rows_run(result[str(stage)], stage, step)
        losses = result["losses"]
        for name in ("sum", "weighted_mean", "pairs", "masked", "default"):
            weights, logged = losses[name]
            assert weights <= 1e-6 and logged <= 1e-5, (name, losses)
        # Whole NumPy batches (worker 0's): the rows' outputs, and the
        # mask of the masked ones, are gathered; the labels are not.
        assert losses["default_gathers"] == 1, losses
        assert losses["masked_gathers"] == 2, losses
        check_local_sgd_runs(result["local_sgd"])


def _check_rows_run(result, stage, step):
    assert result["weight_diff"] <= TOLERANCE, (stage, result)
    assert result["output_diff"] <= TOLERANCE, (stage, result)
    assert abs(result["loss"] - result["reference_loss"]) <= TOLERANCE
    assert result["evaluate_diff"] <= TOLERANCE
    # Every collective of the step is over `data`.
    assert result["stats"] == result["data_stats"]
    calls = {
        kind: (
            entry["forward_calls"],
            entry["backward_calls"],
            entry["optimizer_calls"],
        )
        for kind, entry in result["stats"].items()
    }
    assert calls == step, (stage, calls)
    # The rows' outputs (2 x 2 x 8 float32) and labels (2 x 2 int64), and
    # under ZeRO-3 the weights' partitions.
    gathered = result["stats"]["all_gather"]["forward_bytes"]
    assert gathered == 160 if stage < 3 else gathered > 160
    # predict() reads worker 0's batch (one broadcast) and gathers the
    # rows' predictions.
    assert sorted(result["predict_stats"]) == ["all_gather", "broadcast"]
    # Without ZeRO both rows hold the same weights: replica 0 writes
    # them; under ZeRO each worker writes its partitions.
    _check_checkpoint_round_trip(result, [0] if stage == 0 else [0, 1])


@pytest.mark.parametrize("data_parallel", [1, 2])
def test_dropout_draws_a_mask_per_split_part(data_parallel):
    tp = keras_tp.TensorParallelKeras(
        random_cases.probe_model(),
        world_size=2 * data_parallel,
        data_parallel=data_parallel,
    )
    assert random_cases.per_rank_calls(tp) == {"dropout": (True, False)}
    random_cases.check_masks(random_cases.masked_outputs(tp))
