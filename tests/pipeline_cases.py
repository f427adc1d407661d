"""Pipeline runs shared by the JAX, TensorFlow and torch stage tests.

Each test trains the stages of `keras_tp.pipeline.split_stages` with Adam
through its backend's pipeline, next to the same model on one device.
"""

import warnings

import keras
import numpy as np
import pytest

import keras_tp
from keras_tp.pipeline import bubble_fraction
from keras_tp.pipeline import schedules
from keras_tp.pipeline.cutting import split_stages
from tests import models
from tests import zoo

BATCH = 8
STEPS = 3
MICROBATCHES = 4
LENGTH = 8  # the backbone's sequence length


def mlp_stages():
    """The test MLP as 2 stages of its own layers: `up`, then the rest."""
    split = split_stages(models.mlp(), 2, cut_points=["down"])
    return [stage.model for stage in split.stages]


def mlp_reference():
    """`(loss, reference, its logged loss, x, y)` for `STEPS` batches, the
    one-device run made once per process (callers read it, predict and
    evaluate with it)."""
    key = keras.config.dtype_policy().name
    if key not in _mlp_references:
        loss, x, y = mlp_data()
        reference = models.mlp()
        reference.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
        history = reference.fit(
            x, y, batch_size=BATCH, shuffle=False, verbose=0
        )
        _mlp_references[key] = loss, reference, history.history["loss"][0]
    loss, reference, logged = _mlp_references[key]
    _, x, y = mlp_data()
    return loss, reference, logged, x, y


# `mlp_reference`'s runs, by dtype policy.
_mlp_references = {}


def backbone_reference(optimizer=None, stages=2):
    """`(loss, reference, split, x, y)` of GPT2's backbone, 2 batches.

    Args:
        optimizer: a function returning the reference's optimizer (such as
            `dense_adam`); default `Adam(1e-2)`. The reference trained
            with it is made once per process (callers only read it).
        stages: the number of stages of `split`.
    """
    x, y = models.backbone_data(BATCH * 2, LENGTH)
    loss = keras.losses.MeanSquaredError()
    make = optimizer or _adam
    key = make, keras.config.dtype_policy().name
    if key not in _backbone_references:
        reference = models.gpt2_backbone(length=LENGTH)
        reference.compile(optimizer=make(), loss=loss)
        reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        _backbone_references[key] = reference
    split = split_stages(models.gpt2_backbone(length=LENGTH), stages)
    return loss, _backbone_references[key], split, x, y


def _adam():
    return keras.optimizers.Adam(1e-2)


# `backbone_reference`'s one-device runs, by their optimizer's function
# and dtype policy: every pipeline of GPT2's backbone in a process
# compares with the same run.
_backbone_references = {}


def dense_adam():
    """`Adam(1e-2)` that makes every gradient dense before its update.

    A pipeline sums each stage's gradients over the micro-batches,
    densely; on TensorFlow, Keras gives a one-device model's embedding
    gradient as `IndexedSlices`, which Adam treats row by row.
    """
    # TensorFlow tests only: the other backends' tests do not import it.
    import tensorflow as tf

    optimizer = keras.optimizers.Adam(1e-2)
    apply = optimizer.apply
    optimizer.apply = lambda grads, variables=None: apply(
        [tf.convert_to_tensor(g) for g in grads], variables
    )
    return optimizer


def batches(x, y, steps):
    """`steps` batches of `BATCH` samples of `(x, y)`; `x` may be a dict."""
    for step in range(steps):
        batch = slice(step * BATCH, (step + 1) * BATCH)
        if isinstance(x, dict):
            yield {k: v[batch] for k, v in x.items()}, y[batch]
        else:
            yield x[batch], y[batch]


def two_stages(data_parallel=1, **kwargs):
    """A function `(model, num_microbatches=None) -> TensorParallelKeras`
    of 2 stages on `data_parallel` replicas, a device (rank) each, with
    `kwargs`."""

    def pipelined(model, num_microbatches=None):
        return keras_tp.TensorParallelKeras(
            model,
            world_size=2 * data_parallel,
            pipeline_parallel=2,
            data_parallel=data_parallel,
            num_microbatches=num_microbatches,
            **kwargs,
        )

    return pipelined


def weight_averages_difference(tp):
    """Adam with `use_ema` on the pipelined MLP `tp` and on one device, 3
    epochs of `fit()` (default micro-batches), whose end writes the
    averages into the weights: the largest weight difference."""
    return _one_device_difference(tp, "averages", _averaging_adam, epochs=3)


def _averaging_adam():
    return keras.optimizers.Adam(
        1e-2, use_ema=True, ema_overwrite_frequency=None
    )


def mlp_data():
    """`(loss, x, y)` of `mlp_reference`, for `STEPS` batches."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    x, y = models.data_for("mlp", batch=BATCH * STEPS)
    return loss, x, y


# The one-device MLP's weights after `_one_device_difference`'s run, by
# its key, epochs and dtype policy: a process compares every layout (each
# data axis, stage split) with the same run, trained once.
_one_device_weights = {}


def _one_device_difference(tp, key, optimizer, epochs=2):
    """`optimizer()` on the pipelined MLP `tp` and on one device (its run
    named `key`), `epochs` of `fit()` on `mlp_data`: the largest weight
    difference."""
    loss, x, y = mlp_data()
    # Built each time: the build seeds the random generators, as before a
    # one-device run.
    reference = models.mlp()

    def fit(model):
        model.compile(optimizer=optimizer(), loss=loss)
        model.fit(
            x, y, epochs=epochs, batch_size=BATCH, shuffle=False, verbose=0
        )
        return model.get_weights()

    cached = key, epochs, keras.config.dtype_policy().name
    if cached not in _one_device_weights:
        _one_device_weights[cached] = fit(reference)
    expected, got = _one_device_weights[cached], fit(tp)
    return max(float(np.max(np.abs(a - b))) for a, b in zip(got, expected))


def check_averages_and_accumulation(data_parallel):
    """On 2 stages of `data_parallel` replicas (ZeRO-1 with replicas):
    `weight_averages_difference` and `accumulated_gradients_difference`,
    each within 1e-5 of one device: the default 8 micro-batches add up
    their gradients in another order than one batch, and Adam divides a
    near-zero entry by its own size (5.0e-6 on TensorFlow here, 0.0 with
    one micro-batch, 8.9e-8 with two)."""
    tp_of = two_stages(data_parallel, zero_stage=int(data_parallel > 1))
    assert weight_averages_difference(tp_of(models.mlp())) < 1e-5
    assert accumulated_gradients_difference(tp_of(models.mlp())) < 1e-5
    # Under a loss scale (mixed_float16's), whose inner optimizer keeps
    # the momenta and accumulates.
    scaled = accumulated_gradients_difference(tp_of(models.mlp()), True)
    assert scaled < 1e-5
    for name, difference in state_differences(tp_of, data_parallel).items():
        assert difference < 1e-5, name


def _options():
    """SGD with momentum accumulating 2 steps' gradients, with a schedule
    Keras evaluates at the micro-batches counted, a `loss_scale_factor`
    the backward passes seed, weight decay but on the biases, and moving
    averages Keras moves after every step, accumulating ones too."""
    optimizer = keras.optimizers.SGD(
        keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.7),
        momentum=0.9,
        weight_decay=0.5,
        loss_scale_factor=64.0,
        gradient_accumulation_steps=2,
        use_ema=True,
        ema_momentum=0.5,
    )
    optimizer.exclude_from_weight_decay(var_names=["bias"])
    return optimizer


# Optimizers that keep state Keras does not make from a variable as its
# slot: Nadam's product of momenta, advanced by its own update step;
# Adafactor's factored moments (`add_variable`); moving averages written
# over the weights before every other update, under a loss scale, whose
# optimizer's end of `fit()` writes the averages; and `_options`.
OWN_STATES = {
    "nadam": lambda: keras.optimizers.Nadam(1e-2),
    "adafactor": lambda: keras.optimizers.Adafactor(1e-2),
    "ema_overwrites": lambda: keras.optimizers.LossScaleOptimizer(
        keras.optimizers.SGD(
            0.1,
            momentum=0.9,
            use_ema=True,
            ema_momentum=0.5,
            ema_overwrite_frequency=2,
            gradient_accumulation_steps=2,
        )
    ),
    "options": _options,
}


def state_differences(tp_of, data_parallel):
    """`{name: whole_variable_updates_difference}` of each of
    `OWN_STATES` on the pipelined MLP `tp_of(models.mlp())`; Adafactor's
    only without replicas (which update pieces of its factored
    variables)."""
    return {
        name: whole_variable_updates_difference(tp_of(models.mlp()), optimizer)
        for name, optimizer in OWN_STATES.items()
        if name != "adafactor" or data_parallel == 1
    }


def lamb_clipped():
    """Lamb (each variable's trust ratio of norms), each variable's norm
    clipped."""
    return keras.optimizers.Lamb(1e-2, clipnorm=0.05)


def sgd_clipped():
    """SGD, each variable's norm clipped."""
    return keras.optimizers.SGD(0.1, clipnorm=0.05)


def global_clipped():
    """AdamW, the norm of all the gradients clipped (`global_clipnorm`)."""
    return keras.optimizers.AdamW(1e-2, global_clipnorm=0.05)


def accumulated_and_clipped():
    """SGD with momentum accumulating 2 steps' gradients, the norm of
    all of their mean clipped at each update (`global_clipnorm`)."""
    return keras.optimizers.SGD(
        0.1, momentum=0.9, global_clipnorm=0.05, gradient_accumulation_steps=2
    )


def whole_variable_updates_difference(tp, optimizer=lamb_clipped):
    """An optimizer reading each whole variable (`optimizer()`, by default
    `lamb_clipped`) on the pipelined MLP `tp` and on one device, 2 epochs
    of `fit()`: the largest weight difference."""
    return _one_device_difference(tp, optimizer, optimizer)


def accumulated_gradients_difference(tp, loss_scaled=False):
    """SGD with momentum accumulating 2 steps' gradients
    (`gradient_accumulation_steps`) on the pipelined MLP `tp` and on one
    device, 2 epochs of `fit()`, wrapped in a `LossScaleOptimizer` if
    `loss_scaled`: the largest weight difference."""

    def optimizer():
        optimizer = keras.optimizers.SGD(
            0.1, momentum=0.9, gradient_accumulation_steps=2
        )
        if loss_scaled:
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        return optimizer

    return _one_device_difference(tp, ("accumulated", loss_scaled), optimizer)


def check_weights(reference, stage_models):
    """Asserts every stage's weights equal the reference's within 1e-5."""
    expected = dict(
        zip([v.path for v in reference.weights], reference.get_weights())
    )
    for stage in stage_models:
        for variable in stage.trainable_variables:
            np.testing.assert_allclose(
                keras.ops.convert_to_numpy(variable.value),
                expected[variable.path],
                atol=1e-5,
            )


def check_unsplit_weights(reference, weights):
    """Asserts `get_weights()` of a pipelined model equal the reference's
    within 1e-5."""
    check_unsplit_weights_equal(reference.get_weights(), weights)


def check_unsplit_weights_equal(expected, weights):
    """Asserts two lists of weights are equal within 1e-5."""
    for want, actual in zip(expected, weights, strict=True):
        np.testing.assert_allclose(actual, want, atol=1e-5)


def mlp_stage_bytes():
    """The bytes of the test MLP's stages cut at `down`: `up`, the rest."""
    layers = {layer.name: layer for layer in models.mlp().layers}
    return [
        sum(w.nbytes for name in names for w in layers[name].get_weights())
        for names in (["up"], ["down", "head"])
    ]


def check_mlp_traffic(sent):
    """One (BATCH / MICROBATCHES, 32) float32 activation per micro-batch
    forward, and its gradient back."""
    assert sent["forward_bytes"] == sent["backward_bytes"] == BATCH * 32 * 4
    assert sent["calls"] == 2 * MICROBATCHES


def check_backbone_traffic(sent, split, replicas=1, copies=1, shards=False):
    """At each cut, the hidden states and the carried mask forward; the
    hidden states' gradients back (the integer mask has none).

    Args:
        sent: the `"send"` entry of `communication_stats(axis="pipe")`.
        split: the model's `StageSplit`.
        replicas: the pipeline's replicas, each on its slice of a batch
            in `MICROBATCHES` micro-batches.
        copies: devices of a stage that each receive a whole copy (the
            tensor-parallel devices on JAX), or with `shards` their own
            sequence shard of the hidden states (the mask whole).
        shards: whether the hidden states cross as sequence shards.
    """
    micro = BATCH // (replicas * MICROBATCHES)
    cuts = split.bytes_per_cut(micro, LENGTH)
    hidden = micro * LENGTH * 16 * 4
    saved = len(cuts) * hidden * (copies - 1) // copies if shards else 0
    times = replicas * copies * MICROBATCHES
    assert sent["forward_bytes"] == times * (sum(cuts) - saved)
    assert sent["backward_bytes"] == times * (len(cuts) * hidden - saved)


def check_measured_timeline(timeline, schedule, num_microbatches):
    """A timeline measured from a training step obeys the schedule.

    Each stage ran its actions in the schedule's order, one at a time; a
    micro-batch's forward pass on stage 1 started after stage 0's ended,
    and its backward pass on stage 0 after stage 1's; every stage idled
    part of the step, but not all of it.
    """
    order = schedules.issue_order(schedule, 2, num_microbatches)
    for stage, spans in enumerate(timeline.spans):
        assert [(a.action.kind, a.action.microbatch) for a in spans] == [
            (kind, m) for s, kind, m in order if s == stage
        ]
        for span, following in zip(spans, spans[1:]):
            assert span.start <= span.end <= following.start
    for m in range(num_microbatches):
        forward, backward = schedules.FORWARD, schedules.BACKWARD
        first = timeline.span_of(schedules.Action(0, forward, m))
        second = timeline.span_of(schedules.Action(1, forward, m))
        assert second.start >= first.end
        first = timeline.span_of(schedules.Action(1, backward, m))
        second = timeline.span_of(schedules.Action(0, backward, m))
        assert second.start >= first.end
    for bubble in bubble_fraction(timeline):
        assert 0 < bubble < 1


def check_mlp_pipeline(schedule):
    """Trains the test MLP as 2 stages (`up`, then the rest) with
    `TensorParallelKeras(pipeline_parallel=2)`, next to one device.

    Checks the logged loss, the weights, the traffic, the activations
    held, `predict`, `evaluate` and a direct call.

    Returns:
        The trained model, for the backend's checks of its memory.
    """
    import keras_tp

    loss, reference, logged, x, y = mlp_reference()
    tp = keras_tp.TensorParallelKeras(
        models.mlp(),
        world_size=2,
        pipeline_parallel=2,
        num_microbatches=MICROBATCHES,
        schedule=schedule,
        pipeline_cuts=["down"],
    )
    tp.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    history = tp.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    np.testing.assert_allclose(history.history["loss"][0], logged, rtol=1e-5)
    check_unsplit_weights(reference, tp.get_weights())
    check_mlp_traffic(tp.communication_stats(axis="pipe")["send"])
    # GPipe holds every micro-batch's activations; 1F1B at most as many as
    # the stages from this one to the last.
    expected = [MICROBATCHES] * 2 if schedule == "gpipe" else [2, 1]
    assert schedules.peak_activations(tp._runtime.trained_order) == expected
    np.testing.assert_allclose(
        tp.predict(x, batch_size=BATCH, verbose=0),
        reference.predict(x, batch_size=BATCH, verbose=0),
        atol=1e-5,
    )
    np.testing.assert_allclose(
        tp.evaluate(x, y, batch_size=BATCH, verbose=0),
        reference.evaluate(x, y, batch_size=BATCH, verbose=0),
        rtol=1e-5,
    )
    # Evaluating and predicting send each micro-batch's activation forward.
    for phase in ("test", "predict"):
        sent = tp.communication_stats(phase, axis="pipe")["send"]
        assert sent["forward_bytes"] == sent["bytes"] == BATCH * 32 * 4
        assert sent["calls"] == MICROBATCHES
    np.testing.assert_allclose(tp(x[:BATCH]), reference(x[:BATCH]), atol=1e-5)
    return tp


def check_backbone_pipeline(tp, reference_optimizer=None):
    """Trains GPT2's backbone pipelined by `tp` (uncompiled), next to one
    device: the weights, and the hidden states and carried padding mask
    sent at each cut.

    Args:
        tp: a `TensorParallelKeras` of `models.gpt2_backbone(LENGTH)`.
        reference_optimizer: a function returning the one-device model's
            optimizer, as in `backbone_reference`.
    """
    stages = tp._runtime.pipeline_parallel
    loss, reference, split, x, y = backbone_reference(
        reference_optimizer, stages
    )
    assert tp._runtime.split.cut_points == split.cut_points
    tp.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss)
    tp.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    check_unsplit_weights(reference, tp.get_weights())
    check_backbone_traffic(
        tp.communication_stats(axis="pipe")["send"],
        split,
        tp._runtime.data_parallel,
        tp._runtime.tensor_parallel,
        tp._runtime.sequence_parallel,
    )
    return tp, x, y


def check_split_stage_replicas(
    zero_stage, slots_of=None, reference_optimizer=None
):
    """data x pipe x model, 2 x 2 x 2 on 8 devices: 2 replicas of GPT2's
    backbone in 2 stages, each split 2-way by tensor parallelism, each
    replica training on its half of every batch, next to one device.

    Each stage's replicas combine their gradients once per step, over what
    each device holds of the stage: one all-reduce (DDP), or with ZeRO-1 a
    reduce-scatter and an all-gather of the updated weights, the Adam
    slots partitioned over the replicas. Evaluation and prediction run
    each replica on its slice too.

    Args:
        zero_stage: 0 or 1.
        slots_of: a function of the trained model returning its Adam
            slots; default: the compiled optimizer's.
        reference_optimizer: a function returning the one-device model's
            optimizer, as in `backbone_reference`.

    Returns:
        The trained `TensorParallelKeras`.
    """
    tp, x, y = check_backbone_pipeline(
        keras_tp.TensorParallelKeras(
            models.gpt2_backbone(length=LENGTH),
            world_size=8,
            data_parallel=2,
            pipeline_parallel=2,
            num_microbatches=MICROBATCHES,
            zero_stage=zero_stage,
        ),
        reference_optimizer,
    )
    # Devices 0-3 are replica 0 (stage 0 on 0-1, stage 1 on 2-3); 4-7
    # hold the same shards for replica 1.
    per_device = list(tp.parameter_bytes_per_device().values())
    assert per_device[:4] == per_device[4:]
    assert per_device[0] != per_device[2]
    stage_shards = per_device[0] + per_device[2]
    combined = tp.communication_stats(axis="data")
    kinds = ["reduce_scatter", "all_gather"] if zero_stage else ["all_reduce"]
    assert sorted(combined) == sorted(kinds)
    for kind in kinds:
        assert combined[kind]["calls"] == combined[kind]["optimizer_calls"]
        assert combined[kind]["calls"] == 2
        assert combined[kind]["bytes"] == stage_shards
    slots = slots_of(tp) if slots_of else tp.optimizer.variables[2:]
    assert list(tp._runtime.device_bytes(slots).values()) == [
        2 * b // (1 + zero_stage) for b in per_device
    ]
    one_device = models.gpt2_backbone(length=LENGTH)
    one_device.set_weights(tp.get_weights())
    one_device.compile(loss="mse")
    np.testing.assert_allclose(
        tp.evaluate(x, y, batch_size=BATCH, verbose=0),
        one_device.evaluate(x, y, batch_size=BATCH, verbose=0),
        rtol=1e-5,
    )
    np.testing.assert_allclose(
        tp.predict(x, batch_size=BATCH, verbose=0),
        one_device.predict(x, batch_size=BATCH, verbose=0),
        atol=1e-5,
    )
    sent = tp.communication_stats("predict", axis="pipe")["send"]
    rows = BATCH * LENGTH * (16 * 4 + 4)
    assert sent["forward_bytes"] == 2 * rows  # a copy on each model device
    return tp


def causal_lm_pipeline(tp_of, optimizer=None):
    """Trains keras-hub's GPT2 `CausalLM` pipelined, next to one device.

    Its token embedding also computes the logits, in the last stage: each
    stage that calls it holds it, and their gradients of it are added up
    before the update. Two SGD steps (Adam would turn the float noise of
    near-zero gradients into steps of the learning rate), with sample
    weights as keras-hub's preprocessors make them from the padding (each
    row padded differently), which the micro-batches' losses and the
    weighted accuracy read.

    Args:
        tp_of: a function of the model returning its uncompiled
            `TensorParallelKeras` with `pipeline_parallel=2`.
        optimizer: a function returning the optimizer; by default
            `SGD(1e-2)`. The one-device run with it is made once per
            process.

    Returns:
        `(tp, shared_bytes)`: the trained model, whose unsplit weights
        were checked against one device's, and the bytes of the weights
        its stages share.
    """
    reference, x, y = zoo.gpt2()
    tp = tp_of(zoo.gpt2()[0])
    shared = tp._runtime.split.shared_weights
    assert list(shared.values()) == [[0, 1]]
    assert "token_embedding" in next(iter(shared))
    lengths = np.arange(len(y)) % y.shape[1] + 1
    weights = (np.arange(y.shape[1]) < lengths[:, None]).astype("float32")
    make = optimizer or _sgd

    def train(model):
        model.compile(
            optimizer=make(),
            loss=zoo.loss_for("gpt2"),
            weighted_metrics=["sparse_categorical_accuracy"],
        )
        return [
            model.train_on_batch(x, y, weights, return_dict=True)
            for _ in range(2)
        ]

    key = make, keras.config.dtype_policy().name
    if key not in _causal_lm_references:
        logs = train(reference)
        _causal_lm_references[key] = (
            logs,
            reference,
            reference.predict(x, verbose=0),
        )
    expected_logs, reference, predicted = _causal_lm_references[key]
    for expected, logged in zip(expected_logs, train(tp)):
        for name, value in expected.items():
            assert abs(logged[name] - value) < 1e-5, (name, expected, logged)
    check_unsplit_weights(reference, tp.get_weights())
    np.testing.assert_allclose(tp.predict(x, verbose=0), predicted, atol=1e-5)
    shared_bytes = sum(
        int(np.prod(v.shape)) * 4
        for v in tp._runtime.split.model.weights
        if v.path in shared
    )
    return tp, shared_bytes


def _sgd():
    return keras.optimizers.SGD(1e-2)


# `causal_lm_pipeline`'s one-device runs, by their optimizer's function
# and dtype policy: `(the logs of its 2 steps, the trained model, its
# predictions)`, made once per process.
_causal_lm_references = {}


def check_zoo_lm_pipeline(name, tp_of):
    """Trains zoo LM `name` pipelined, 2 SGD steps, next to one device:
    the weights and the predictions within 1e-5.

    Args:
        name: a `tests.zoo` model function's name.
        tp_of: a function of the model returning its uncompiled
            `TensorParallelKeras`.
    """
    reference, x, y = getattr(zoo, name)()
    tp = tp_of(getattr(zoo, name)()[0])
    for model in (reference, tp):
        model.compile(
            optimizer=keras.optimizers.SGD(1e-2), loss=zoo.loss_for(name)
        )
        for _ in range(2):
            model.train_on_batch(x, y)
    check_unsplit_weights(reference, tp.get_weights())
    np.testing.assert_allclose(
        tp.predict(x, verbose=0), reference.predict(x, verbose=0), atol=1e-5
    )


def check_split_causal_lm(data_parallel, tensor_parallel, zero_stage):
    """`causal_lm_pipeline` on `data_parallel` replicas of 2 stages, each
    split `tensor_parallel` ways, with `zero_stage`, 2 micro-batches, and
    `check_causal_lm_traffic`: the first stage's devices own the tied
    embedding, the last stage's receive a copy once a step and send its
    gradient back, each device its shard, each replica its own.

    Returns:
        `(tp, embedding)`: the trained model and its token embedding.
    """
    microbatches = 2
    tp, shared_bytes = causal_lm_pipeline(
        lambda model: keras_tp.TensorParallelKeras(
            model,
            world_size=2 * data_parallel * tensor_parallel,
            pipeline_parallel=2,
            data_parallel=data_parallel,
            zero_stage=zero_stage,
            num_microbatches=microbatches,
        )
    )
    check_causal_lm_traffic(
        tp,
        microbatches,
        shared_bytes,
        copies=1,
        replicas=data_parallel,
        tensor_parallel=tensor_parallel,
    )
    embedding = next(
        v for v in tp.trainable_variables if "token_embedding" in v.path
    )
    return tp, embedding


def check_causal_lm_traffic(
    tp, microbatches, shared_bytes, copies, replicas=1, tensor_parallel=1
):
    """Asserts what crossed the cut of `causal_lm_pipeline`'s 2 stages in
    its last step: each micro-batch's hidden states and padding mask
    forward, and the hidden states' gradients back, whole to each
    tensor-parallel device; and the shared embedding, `copies` times
    forward, its gradient once back, to and from each replica (each
    device its shard).

    Args:
        tp: the trained model.
        microbatches: its number of micro-batches.
        shared_bytes: the bytes of its shared weights.
        copies: how many times a step sends them forward.
        replicas: the replicas of the pipeline.
        tensor_parallel: the devices that split each stage.
    """
    sent = tp.communication_stats(axis="pipe")["send"]
    (boundary,) = tp._runtime.split.boundaries
    size = zoo.BATCH // microbatches
    hidden = sum(
        t.nbytes(size, zoo.SEQ_LEN)
        for t in boundary.tensors
        if t.dtype.startswith("float")
    )
    activations = microbatches * tensor_parallel
    assert sent["forward_bytes"] == (
        activations * boundary.nbytes(size, zoo.SEQ_LEN)
        + copies * replicas * shared_bytes
    )
    assert sent["backward_bytes"] == (
        activations * hidden + replicas * shared_bytes
    )


def check_masked_predictions(tp_of):
    """A Keras mask made in stage 0 (`Embedding(mask_zero=True)`) crosses
    the cut to the loss: with one micro-batch and with two, whose rows
    (and replicas, with a data axis) hold different numbers of masked
    tokens, `evaluate()`, the first loss and the weights after a step
    equal one device's, without a warning.

    Args:
        tp_of: function `(model, num_microbatches) -> TensorParallelKeras`
            of 2 stages.
    """
    from tests.dp_cases import masked_tagger

    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 10, size=(BATCH, 6)).astype("int32")
    tokens[BATCH // 2 :, 2:] = 0
    tokens[BATCH // 4 : BATCH // 2, 4:] = 0
    tags = rng.integers(0, 4, size=(BATCH, 6))
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    reference = masked_tagger()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
    evaluated = reference.evaluate(tokens, tags, batch_size=BATCH, verbose=0)
    expected = float(reference.train_on_batch(tokens, tags))
    for microbatches in (1, 2):
        tp = tp_of(masked_tagger(), microbatches)
        tp.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tp_evaluated = tp.evaluate(
                tokens, tags, batch_size=BATCH, verbose=0
            )
            logged = float(tp.train_on_batch(tokens, tags))
        masks = [w for w in caught if "Keras mask" in str(w.message)]
        assert not masks, masks[0].message
        assert abs(tp_evaluated - evaluated) < 1e-6, (tp_evaluated, evaluated)
        assert abs(logged - expected) < 1e-6, (logged, expected)
        check_unsplit_weights(reference, tp.get_weights())


class MeanSquarePenalty(keras.layers.Layer):
    """Adds a tenth of its input's mean square to the loss (`add_loss` in
    its `call`), a mean over samples."""

    def call(self, x):
        self.add_loss(0.1 * keras.ops.mean(keras.ops.square(x)))
        return x


def regularized_mlp():
    """An MLP whose layers add losses on both sides of its 2-stage cut:
    weight and activity regularizers, and `MeanSquarePenalty`."""
    keras.utils.set_random_seed(0)
    l2 = keras.regularizers.L2(0.01)
    inputs = keras.Input((6,))
    h = keras.layers.Dense(
        16,
        activation="tanh",
        kernel_regularizer=l2,
        activity_regularizer=keras.regularizers.L1(0.01),
        name="first",
    )(inputs)
    h = MeanSquarePenalty(name="penalty")(keras.layers.Dense(16)(h))
    h = keras.layers.Dense(16, activation="tanh", kernel_regularizer=l2)(h)
    return keras.Model(inputs, keras.layers.Dense(3, name="head")(h))


def check_added_losses(tp_of):
    """Losses the layers of both stages add (regularizers, `add_loss`)
    enter the loss and the gradients as on one device: `evaluate()`, the
    logged losses and the weights after two SGD steps, with one
    micro-batch and with two; with two the `add_loss` layer is named in a
    warning (each
    micro-batch computes it on its own samples). Masked predictions with
    such losses are refused where micro-batches split the batch.

    Args:
        tp_of: function `(model, num_microbatches) -> TensorParallelKeras`
            of 2 stages.
    """
    split = split_stages(regularized_mlp(), 2)
    assert "penalty" in split.stages[0].layer_names
    assert all(stage.model.losses for stage in split.stages)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 6)).astype("float32")
    y = rng.normal(size=(BATCH, 3)).astype("float32")
    reference = regularized_mlp()
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    evaluated = reference.evaluate(x, y, batch_size=BATCH, verbose=0)
    expected = [float(reference.train_on_batch(x, y)) for _ in range(2)]
    for microbatches in (1, 2):
        tp = tp_of(regularized_mlp(), microbatches)
        tp.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            tp_evaluated = tp.evaluate(x, y, batch_size=BATCH, verbose=0)
            logged = [float(tp.train_on_batch(x, y)) for _ in range(2)]
        assert abs(tp_evaluated - evaluated) < 1e-6, (tp_evaluated, evaluated)
        named = [w for w in caught if "['penalty']" in str(w.message)]
        data_parallel = tp.get_parallelism_info()["data_parallel"]
        assert bool(named) == (microbatches * data_parallel > 1)
        np.testing.assert_allclose(logged, expected, rtol=1e-5)
        check_unsplit_weights(reference, tp.get_weights())
    # A loss scale (in float32, a power of two: exact) seeds the added
    # losses' gradients as it seeds the loss's.
    tp = tp_of(regularized_mlp(), 2)
    scaled = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.1))
    tp.compile(optimizer=scaled, loss="mse")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        logged = [float(tp.train_on_batch(x, y)) for _ in range(2)]
    np.testing.assert_allclose(logged, expected, rtol=1e-5)
    check_unsplit_weights(reference, tp.get_weights())
    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(10, 8, mask_zero=True)(tokens)
    h = keras.layers.Dense(4, kernel_regularizer="l2")(h)
    tp = tp_of(keras.Model(tokens, h), 2)
    tp.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    tokens = np.ones((BATCH, 6), "int32")
    with pytest.raises(ValueError, match="would scale the added losses"):
        tp.train_on_batch(tokens, np.zeros((BATCH, 6), "int32"))


def loss_scale_overflow(data_parallel, global_clipnorm=None):
    """`mixed_float16` SGD of the MLP on 2 stages of `data_parallel`
    replicas (ZeRO-1 with replicas) and on one device, for 3 batches
    whose first overflows in its last sample (on the last micro-batch and
    replica): the step is skipped and the scale halved on every stage, as
    on one device. With `global_clipnorm`, the norm of every stage's
    gradients once unscaled clips them, as the scale's inner optimizer
    clips them on one device.

    Returns:
        `(largest weight difference, [one device's scale, the
        pipeline's], [their steps applied])`.
    """
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        x, y = models.data_for("mlp", batch=3 * BATCH)
        # Past float16's largest value: inf in the first layer's inputs.
        x[BATCH - 1] = 1e5
        tp_of = two_stages(data_parallel, zero_stage=int(data_parallel > 1))
        trained = (models.mlp(), tp_of(models.mlp()))
        for model in trained:
            model.compile(
                optimizer=keras.optimizers.SGD(
                    0.1, global_clipnorm=global_clipnorm
                ),
                loss=loss,
            )
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        expected, got = (model.get_weights() for model in trained)
        difference = max(
            float(np.max(np.abs(a - b))) for a, b in zip(got, expected)
        )
        scales = [
            float(keras.ops.convert_to_numpy(m.optimizer.dynamic_scale))
            for m in trained
        ]
        steps = [
            int(keras.ops.convert_to_numpy(m.optimizer.iterations))
            for m in trained
        ]
        return difference, scales, steps
    finally:
        keras.mixed_precision.set_global_policy(policy)


def check_loss_scale_overflow(result):
    difference, scales, steps = result
    # 32768 at the start, halved once, on one device and on every stage;
    # 2 of the 3 steps applied.
    assert scales == [16384.0, 16384.0], result
    assert steps == [2, 2], result
    assert difference < 1e-4, result
