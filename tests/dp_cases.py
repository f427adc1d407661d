"""Training runs shared by the DDP and ZeRO tests of every backend.

The oracle of each run is the same model on one device, trained on the
whole global batch; the runs themselves only use keras_tp's public API, so
JAX and TensorFlow call them in the test process and torch on every rank.
"""

import math

import keras
import numpy as np
import pytest

import keras_tp
from keras_tp.parallel import bucket_probe
from keras_tp.parallel.loss_scaling import GlobalLossScaleOptimizer
from tests import models
from tests.models import loss_fn
from tests.models import max_diff

STEPS = 5
BATCH = 8  # global batch, split over the data axis


# The optimizers of `make_optimizer` that accumulate gradients themselves:
# a step of each is a micro-batch, on one device too.
ACCUMULATING = {"averaged_accumulating": 2, "options": 2}


def accumulation_steps(kind, options):
    """The micro-batches of an update of `kind` with `options`."""
    steps = options.get("gradient_accumulation_steps", 1)
    return steps * ACCUMULATING.get(kind, 1)


def make_optimizer(kind, model=None):
    """SGD with momentum, Adam, AdamW with clipping and a schedule,
    ("clipped") SGD with momentum, a norm clip per variable and weight
    averages, ("scaled_nadam") Nadam under a loss scale,
    ("averaged_accumulating") SGD with momentum accumulating 2 steps'
    gradients, weight averages written over the weights before every
    third update, or ("options") SGD with momentum accumulating 2 steps'
    gradients, with a schedule Keras evaluates at the micro-batches
    counted, a `loss_scale_factor`, and weight decay but on `model`'s
    biases (`ACCUMULATING`)."""
    if kind == "sgd":
        return keras.optimizers.SGD(0.05, momentum=0.9)
    if kind == "options":
        optimizer = keras.optimizers.SGD(
            keras.optimizers.schedules.ExponentialDecay(0.05, 1, 0.7),
            momentum=0.9,
            weight_decay=0.5,
            loss_scale_factor=64.0,
            gradient_accumulation_steps=ACCUMULATING[kind],
        )
        biases = [v for v in model.trainable_variables if "bias" in v.path]
        optimizer.exclude_from_weight_decay(var_list=biases)
        return optimizer
    if kind == "averaged_accumulating":
        return keras.optimizers.SGD(
            0.05,
            momentum=0.9,
            use_ema=True,
            ema_momentum=0.5,
            ema_overwrite_frequency=3,
            gradient_accumulation_steps=ACCUMULATING[kind],
        )
    if kind == "clipped":
        return keras.optimizers.SGD(
            0.05, momentum=0.9, clipnorm=0.05, use_ema=True
        )
    if kind == "lamb":
        return keras.optimizers.Lamb(1e-2)
    if kind == "adam":
        return keras.optimizers.Adam(1e-3)
    if kind == "scaled_nadam":
        return keras.optimizers.LossScaleOptimizer(keras.optimizers.Nadam(1e-2))
    schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, 2, 0.8)
    return keras.optimizers.AdamW(
        schedule, weight_decay=0.05, global_clipnorm=0.5
    )


def train_pair(name, world_size, data_parallel, zero_stage, kind, **options):
    """Trains `name` on one device and on a `data x model` mesh.

    Args:
        name: a model of `tests.models.BUILDERS`.
        world_size, data_parallel, zero_stage: the mesh and the stage.
        kind: the optimizer, see `make_optimizer`.
        **options: arguments of a `CoordinatedOptimizer` built explicitly.

    Returns:
        `(reference, tp, reference_history, tp_history)`.
    """
    steps = options.get("gradient_accumulation_steps", 1)
    # Whole updates only: a trailing partial accumulation is not applied.
    samples = (STEPS // steps) * steps * BATCH
    x, y = models.data_for(name, batch=samples)
    reference, ref_history = _one_device_run(name, kind, steps, x, y)
    tp, tp_history = train_split(
        name, world_size, data_parallel, zero_stage, kind, **options
    )
    return reference, tp, ref_history, tp_history


def train_split(name, world_size, data_parallel, zero_stage, kind, **options):
    """`train_pair`'s `(tp, tp_history)` alone, with no one-device run."""
    steps = options.get("gradient_accumulation_steps", 1)
    x, y = models.data_for(name, batch=(STEPS // steps) * steps * BATCH)
    wrapped = models.BUILDERS[name]()
    tp = keras_tp.TensorParallelKeras(
        wrapped,
        world_size=world_size,
        data_parallel=data_parallel,
        zero_stage=zero_stage,
    )
    optimizer = make_optimizer(kind, wrapped)
    if options:
        optimizer = keras_tp.CoordinatedOptimizer(
            optimizer, zero_stage=zero_stage, **options
        )
    tp.compile(optimizer=optimizer, loss=loss_fn(), metrics=["accuracy"])
    return tp, tp.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)


# `train_pair`'s one-device runs, by model, optimizer, accumulated steps
# and dtype policy: a process compares every layout of a model and
# optimizer (each world size, data axis and ZeRO stage) with the same run,
# trained once. Callers read its weights and history, or evaluate it.
_one_device_runs = {}


def _one_device_run(name, kind, steps, x, y):
    """`(reference, its history)`: `name` on one device, `kind`'s
    optimizer, batches of `BATCH * steps` of `(x, y)`."""
    key = name, kind, steps, keras.config.dtype_policy().name
    if key not in _one_device_runs:
        reference = models.BUILDERS[name]()
        reference.compile(
            optimizer=make_optimizer(kind, reference), loss=loss_fn()
        )
        history = reference.fit(
            x, y, batch_size=BATCH * steps, shuffle=False, verbose=0
        )
        _one_device_runs[key] = reference, history
    return _one_device_runs[key]


def check_norms_with_tensor_parallelism_alone():
    """Norm clips (per variable and global), weight averages and a
    schedule on 2 model ranks without a data axis match one device: where
    ranks hold their shards, `compile()` makes the optimizer a
    `CoordinatedOptimizer`, which takes each norm over the shards."""
    for kind, tolerance in (("clipped", 1e-5), ("adamw", 1e-4)):
        reference, tp, _, _ = train_pair("mlp", 2, 1, 0, kind)
        assert max_diff(reference.get_weights(), tp.get_weights()) <= (
            tolerance
        ), kind


def check_state_kept_beside_the_variables():
    """Nadam under a loss scale keeps its product of momenta in a variable
    it does not list: each replica advances its own copy, with tensor
    parallelism alone and with 2 data ranks, as one device does. Weight
    averages of an optimizer that accumulates gradients move after every
    step, as one device's do, on ZeRO-1's partitions too; so does its
    schedule, and its loss scale factor and the variables it keeps from
    weight decay hold."""
    for world_size, data_parallel, zero_stage, kind in (
        (2, 1, 0, "scaled_nadam"),
        (2, 2, 0, "scaled_nadam"),
        (2, 2, 1, "averaged_accumulating"),
        (2, 2, 1, "options"),
    ):
        reference, tp, _, _ = train_pair(
            "mlp", world_size, data_parallel, zero_stage, kind
        )
        difference = max_diff(reference.get_weights(), tp.get_weights())
        assert difference <= 1e-5, (world_size, data_parallel, kind)


def lamb_refusal(world_size, data_parallel, zero_stage):
    """LAMB, whose trust ratio reads each variable's norm, on a layout whose
    ranks update pieces of the variables: `compile()`'s message."""
    tp = keras_tp.TensorParallelKeras(
        models.mlp(),
        world_size=world_size,
        data_parallel=data_parallel,
        zero_stage=zero_stage,
    )
    with pytest.raises(ValueError) as refused:
        tp.compile(optimizer=make_optimizer("lamb"), loss=loss_fn())
    return str(refused.value)


def constrained_mlp(down_constraint):
    """`models.mlp`'s layers with `MaxNorm(axis=0)` on `up`'s kernel (each
    output unit's norm: whole on each rank of its Column split) and
    `down_constraint` on `down`'s, which a Row split cuts along axis 0."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    up = keras.constraints.MaxNorm(0.5, axis=0)
    x = keras.layers.Dense(
        32, activation="relu", name="up", kernel_constraint=up
    )(inputs)
    x = keras.layers.Dense(
        32, activation="relu", name="down", kernel_constraint=down_constraint
    )(x)
    outputs = keras.layers.Dense(8, name="head")(x)
    return keras.Model(inputs, outputs, name="constrained_mlp")


def constraint_refusal(world_size, data_parallel):
    """`compile()`'s message for `MaxNorm(axis=0)` on `down`'s kernel, of
    which each rank holds rows."""
    tp = keras_tp.TensorParallelKeras(
        constrained_mlp(keras.constraints.MaxNorm(0.5, axis=0)),
        world_size=world_size,
        data_parallel=data_parallel,
    )
    with pytest.raises(ValueError) as refused:
        tp.compile(optimizer="sgd", loss=loss_fn())
    return str(refused.value)


def constrained_difference(world_size, data_parallel):
    """The largest weight difference from one device after an epoch of
    SGD with `NonNeg` on `down`'s kernel, which holds entry by entry."""
    reference = constrained_mlp(keras.constraints.NonNeg())
    tp = keras_tp.TensorParallelKeras(
        constrained_mlp(keras.constraints.NonNeg()),
        world_size=world_size,
        data_parallel=data_parallel,
    )
    x, y = models.data_for("mlp", batch=16)
    for model in (reference, tp):
        model.compile(optimizer=keras.optimizers.SGD(0.5), loss=loss_fn())
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    return max_diff(reference.get_weights(), tp.get_weights())


def kept_bytes(psi, data_parallel, zero_stage, accumulation_steps=1):
    """`(parameter, gradient, Adam state)` bytes a rank keeps between steps.

    ZeRO's partitions of parameters and Adam state; gradients are kept
    only to accumulate micro-batches: whole under DDP and ZeRO-1, a
    partition under ZeRO-2 and 3 (none with one micro-batch per update,
    as in plain Keras).

    Args:
        psi: bytes of the trainable parameters (of one tensor-parallel
            shard).
        data_parallel: size of the data axis.
        zero_stage: 0 (DDP) to 3.
        accumulation_steps: the optimizer's `gradient_accumulation_steps`.
    """
    d = data_parallel
    parameters = psi / d if zero_stage == 3 else psi
    gradients = psi / d if zero_stage >= 2 else psi
    if accumulation_steps == 1:
        gradients = 0
    adam = 2 * psi / d if zero_stage >= 1 else 2 * psi
    return parameters, gradients, adam


def batchnorm_network():
    """Dense -> BatchNormalization -> Dense, on 16 features."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((16,))
    x = keras.layers.Dense(32, name="up")(inputs)
    x = keras.layers.BatchNormalization(name="norm")(x)
    outputs = keras.layers.Dense(8, name="head")(x)
    return keras.Model(inputs, outputs)


def batchnorm_after_two_steps(world_size, data_parallel, zero_stage):
    """A BatchNorm network after two data-parallel SGD steps.

    Each data rank holds its part of the batch; BatchNormalization
    normalises by the global batch's statistics, all-reduced over `data`
    (`keras_tp.parallel.batch_statistics`), so the weights and the moving
    statistics are one device's. On a rank's part alone they would differ
    by about 1e-2 after two steps.

    Returns:
        `(largest difference to one device, check_gradient_consistency())`.
    """

    reference = batchnorm_network()
    tp = keras_tp.TensorParallelKeras(
        batchnorm_network(),
        world_size=world_size,
        data_parallel=data_parallel,
        zero_stage=zero_stage,
    )
    x, y = models.data_for("mlp", batch=BATCH)
    for model in (reference, tp):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss_fn())
        for _ in range(2):
            model.train_on_batch(x, y)
    difference = max_diff(reference.get_weights(), tp.get_weights())
    return difference, tp.check_gradient_consistency()


class BatchContrast(keras.losses.Loss):
    """Each sample's logits against every sample's of the batch: a loss
    over pairs of samples, as SigLIP's and CLIP's are."""

    def call(self, y_true, y_pred):
        similarity = keras.ops.matmul(y_pred, keras.ops.transpose(y_pred))
        return -keras.ops.diagonal(keras.ops.log_softmax(similarity, axis=-1))


def masked_tagger():
    """A tag per token, whose predictions carry the tokens' mask."""
    keras.utils.set_random_seed(0)
    tokens = keras.Input((6,), dtype="int32")
    x = keras.layers.Embedding(10, 8, mask_zero=True, name="embedding")(tokens)
    return keras.Model(tokens, keras.layers.Dense(4, name="head")(x))


def global_batch_losses(world_size, data_parallel):
    """Two data-parallel SGD steps with losses whose rows' mean is not the
    global batch's (`keras_tp.parallel.batch_loss`): a `"sum"`, a
    `"mean_with_sample_weight"` with uneven weights, a loss over pairs of
    samples, and the default loss on predictions masked unevenly across
    rows. The default loss of unmasked predictions, a mean of Keras'
    per-sample values, gathers nothing over `data`; nor does that of the
    masked ones, weighed by each row's share of unmasked entries.

    Returns:
        `{run name: (largest weight difference to one device, difference
        of the last logged loss), "default_gathers" and "masked_gathers":
        all-gathers over data in those runs' steps}`.
    """
    x, y = models.data_for("mlp", batch=BATCH)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 10, size=(BATCH, 6)).astype("int32")
    tokens[BATCH // 2 :, 2:] = 0  # the last row's samples end early
    tags = rng.integers(0, 4, size=(BATCH, 6))
    weights = np.array([1, 1, 1, 1, 1, 0, 0, 2], "float32")
    runs = {
        "sum": (
            models.mlp,
            x,
            y,
            keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction="sum"
            ),
        ),
        "weighted_mean": (
            models.mlp,
            x,
            y,
            keras.losses.SparseCategoricalCrossentropy(
                from_logits=True, reduction="mean_with_sample_weight"
            ),
        ),
        "pairs": (models.mlp, x, y, BatchContrast()),
        "masked": (masked_tagger, tokens, tags, loss_fn()),
        "default": (models.mlp, x, y, loss_fn()),
    }
    results = {}
    for name, (build, inputs, labels, loss) in runs.items():
        per_sample = None if name == "masked" else weights
        reference = build()
        tp = keras_tp.TensorParallelKeras(
            build(), world_size=world_size, data_parallel=data_parallel
        )
        logged = []
        for model in (reference, tp):
            model.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss)
            for _ in range(2):
                value = model.train_on_batch(
                    inputs, labels, sample_weight=per_sample
                )
            logged.append(float(value))
        difference = max_diff(reference.get_weights(), tp.get_weights())
        results[name] = (difference, abs(logged[0] - logged[1]))
        if name in ("default", "masked"):
            stats = tp.communication_stats("train", axis="data")
            results[f"{name}_gathers"] = stats.get("all_gather", {}).get(
                "calls", 0
            )
    return results


def check_global_batch_losses(results):
    for name in ("sum", "weighted_mean", "pairs", "masked", "default"):
        weights, logged = results[name]
        assert weights <= 1e-6 and logged <= 1e-5, (name, results[name])
    assert results["default_gathers"] == 0, results
    assert results["masked_gathers"] == 0, results


def communication_run(zero_stage, bucket_mb):
    """One step of the MLP on 4 data ranks with buckets of `bucket_mb`.

    Returns:
        `(tp, psi, x, y)`: the model, the bytes of its trainable
        parameters, and the batch it trained on.
    """
    tp = keras_tp.TensorParallelKeras(
        models.mlp(), world_size=4, data_parallel=4, zero_stage=zero_stage
    )
    optimizer = keras_tp.CoordinatedOptimizer(
        keras.optimizers.Adam(1e-3),
        zero_stage=zero_stage,
        bucket_cap_mb=bucket_mb,
    )
    tp.compile(optimizer=optimizer, loss=loss_fn())
    x, y = models.data_for("mlp", batch=BATCH)
    tp.fit(x, y, batch_size=BATCH, verbose=0)
    psi = sum(v.numpy().nbytes for v in models.mlp().trainable_variables)
    return tp, psi, x, y


def check_data_traffic(tp, psi, zero_stage, bucket_mb):
    """Asserts the bytes a step sends over `data`, stage by stage.

    DDP all-reduces psi in ceil(psi / bucket) calls; ZeRO-1 and 2
    reduce-scatter psi and all-gather psi; ZeRO-3 with one gather per
    parameter (JAX, TensorFlow) all-gathers psi forward and reduce-scatters
    psi backward.
    """
    data = tp.communication_stats(axis="data")
    synced = {
        kind: entry["optimizer_bytes"]
        for kind, entry in data.items()
        if entry["optimizer_bytes"]
    }
    if zero_stage == 0:
        assert synced == {"all_reduce": psi}
        calls = math.ceil(psi / (bucket_mb * 2**20))
        assert data["all_reduce"]["optimizer_calls"] == calls
        assert len(tp.get_gradient_sharding_info()["buckets"]) == calls
    elif zero_stage in (1, 2):
        assert synced == {"reduce_scatter": psi, "all_gather": psi}
    else:
        assert synced == {}
        assert data["all_gather"]["forward_bytes"] == psi
        assert (
            data["all_gather"]["calls"] == data["all_gather"]["forward_calls"]
        )
        assert data["reduce_scatter"]["backward_bytes"] == psi


def check_zero_memory(
    bytes_per_rank, psi, data_parallel, zero_stage, accumulation_steps=1
):
    """Asserts one rank's bytes follow `kept_bytes` within 5% (Adam).

    Without accumulation no gradient byte is kept between steps.

    Args:
        bytes_per_rank: `(parameter, gradient, optimizer)` bytes of the
            rank, measured from its arrays.
        psi: bytes of the trainable parameters.
        data_parallel, zero_stage: the mesh and the stage.
        accumulation_steps: the optimizer's `gradient_accumulation_steps`.
    """
    parameters, gradients, optimizer = bytes_per_rank
    expected = kept_bytes(psi, data_parallel, zero_stage, accumulation_steps)
    assert abs(parameters - expected[0]) <= 0.05 * expected[0]
    assert abs(gradients - expected[1]) <= 0.05 * expected[1]
    scalars = 64  # step counters and learning rates
    assert 0.95 * expected[2] <= optimizer <= 1.05 * expected[2] + scalars


def accumulation_buffer_bytes(data_parallel):
    """Gradient bytes kept by a built optimizer accumulating 2 micro-batches.

    Builds the MLP's optimizer at every stage as the first step would
    (placed on the replicas on TensorFlow), without training: the buffers
    exist from the build on.

    Returns:
        `[(zero_stage, psi, {device: bytes})]`.
    """
    psi = sum(v.numpy().nbytes for v in models.mlp().trainable_variables)
    results = []
    for stage in (0, 1, 2, 3):
        tp = keras_tp.TensorParallelKeras(
            models.mlp(),
            world_size=data_parallel,
            data_parallel=data_parallel,
            zero_stage=stage,
        )
        optimizer = keras_tp.CoordinatedOptimizer(
            keras.optimizers.SGD(0.1),
            zero_stage=stage,
            gradient_accumulation_steps=2,
        )
        tp.compile(optimizer=optimizer, loss=loss_fn())
        tp._runtime.build_optimizer(tp)
        results.append((stage, psi, tp.gradient_bytes_per_device()))
    return results


def check_accumulation_buffers(results, data_parallel):
    """Asserts `accumulation_buffer_bytes`: on every rank, a whole
    gradient under DDP and ZeRO-1, a `1 / data_parallel` partition under
    ZeRO-2 and 3 (every variable of the MLP is partitioned)."""
    for stage, psi, per_device in results:
        _, expected, _ = kept_bytes(psi, data_parallel, stage, 2)
        assert set(per_device.values()) == {expected}, (stage, per_device)


def check_matches_one_device(reference, tp, reference_history, tp_history):
    """Asserts a `train_pair` run equals one device after `STEPS` steps.

    The weights agree to 1e-5, the logged loss is the global batch's (not
    one rank's), and every replica holds the same numbers.
    """
    assert int(tp.optimizer.iterations.numpy()) == STEPS
    assert max_diff(reference.get_weights(), tp.get_weights()) <= 1e-5
    np.testing.assert_allclose(
        tp_history.history["loss"],
        reference_history.history["loss"],
        rtol=1e-5,
    )
    report = tp.check_gradient_consistency()
    assert report["consistent"], report


def any_sample_count(reference, tp):
    """Predictions and evaluate logs of `tp` and of one device on 11
    samples in batches of 3, 3, 3 and 2: the first three do not divide by
    `data_parallel=2`. Evaluated with sample weights.

    `reference` and `tp` are compiled alike (`metrics=["accuracy"]`).
    Plain numbers, so that torch ranks return them.
    """
    x, y = models.data_for("mlp", batch=11, seed=5)
    weights = np.random.default_rng(5).uniform(size=11).astype("float32")
    results = {}
    for batch in (3,):
        predicted = tp.predict(x, batch_size=batch, verbose=0)
        results[f"predict_{batch}"] = {
            "shape": list(predicted.shape),
            "difference": max_diff(
                [reference.predict(x, batch_size=batch, verbose=0)],
                [predicted],
            ),
        }
        # The loss weighs the samples; the accuracy (a plain metric) not.
        logs = [
            model.evaluate(
                x,
                y,
                sample_weight=weights,
                batch_size=batch,
                verbose=0,
                return_dict=True,
            )
            for model in (tp, reference)
        ]
        results[f"evaluate_{batch}"] = [
            {k: float(v) for k, v in log.items()} for log in logs
        ]
    return results


def check_any_sample_count(results):
    """Asserts `any_sample_count`'s results are one device's."""
    for batch in (3,):
        predicted = results[f"predict_{batch}"]
        assert predicted["shape"] == [11, 8]
        assert predicted["difference"] <= 1e-5
        tp_logs, reference_logs = results[f"evaluate_{batch}"]
        assert set(tp_logs) == set(reference_logs) == {"loss", "accuracy"}
        for key, value in reference_logs.items():
            assert tp_logs[key] == pytest.approx(value, rel=1e-5), key


def check_link_probe(info):
    """Asserts `bucket_cap_mb="auto"` measured the data axis and used it.

    Args:
        info: the model's `get_gradient_sharding_info()`.
    """
    probe = info["link_probe"]
    assert len(probe["times_us"]) == len(bucket_probe.PROBE_BYTES)
    assert all(t > 0 for t in probe["times_us"].values())
    assert probe["latency_us"] > 0 and probe["bandwidth_gb_per_s"] > 0
    assert info["bucket_cap_mb"] == pytest.approx(probe["bucket_cap_mb"], 1e-3)
    lowest, highest = bucket_probe.SMALLEST_MB, bucket_probe.LARGEST_MB
    assert lowest <= info["bucket_cap_mb"] <= highest


# Local SGD ---------------------------------------------------------------

LOCAL_DATA_PARALLEL = 2


def _replica_slices(x, replicas):
    """Each replica's slices of every global batch of `x`, in order."""
    batches = x.reshape((-1, replicas, BATCH // replicas) + x.shape[1:])
    return [batches[:, r].reshape((-1,) + x.shape[1:]) for r in range(replicas)]


def local_sgd_reference(x, y, kind, rounds, outer=None):
    """The weights local SGD must reach, from replicas trained apart.

    Each replica is the MLP on one device, trained on its own slices of
    the global batches with its own optimizer state; after each round of
    steps the replicas take the average of their weights or, with an
    outer optimizer, the anchor it moves by the replicas' mean move. One
    model, compiled once, trains every replica in turn.

    Args:
        x, y: the global batches, `sum(rounds)` of `BATCH` samples.
        kind: the inner optimizer (`make_optimizer`).
        rounds: the number of steps between synchronisations, in order.
        outer: the outer optimizer, or `None` to average.

    Returns:
        The weights after the last synchronisation.
    """
    model = models.mlp()
    model.compile(optimizer=make_optimizer(kind), loss=loss_fn())
    model.optimizer.build(model.trainable_variables)
    slots = model.optimizer.variables
    replicas = [
        (model.get_weights(), [v.numpy() for v in slots])
    ] * LOCAL_DATA_PARALLEL
    anchors = [keras.Variable(w) for w in model.get_weights()]
    xs = _replica_slices(x, LOCAL_DATA_PARALLEL)
    ys = _replica_slices(y, LOCAL_DATA_PARALLEL)
    size = BATCH // LOCAL_DATA_PARALLEL
    start = 0
    for steps in rounds:
        stop = start + steps * size
        for r, (weights, state) in enumerate(replicas):
            model.set_weights(weights)
            for variable, value in zip(slots, state):
                variable.assign(value)
            model.fit(
                xs[r][start:stop],
                ys[r][start:stop],
                batch_size=size,
                shuffle=False,
                verbose=0,
            )
            replicas[r] = (model.get_weights(), [v.numpy() for v in slots])
        start = stop
        mean = [
            np.mean(copies, axis=0)
            for copies in zip(*[weights for weights, _ in replicas])
        ]
        if outer is not None:
            moves = [a.numpy() - m for a, m in zip(anchors, mean)]
            outer.apply(
                [keras.ops.convert_to_tensor(m) for m in moves], anchors
            )
            mean = [a.numpy() for a in anchors]
        replicas = [(mean, state) for _, state in replicas]
    return mean


def _local_sgd_model(kind, steps, outer=None):
    tp = keras_tp.TensorParallelKeras(
        models.mlp(),
        world_size=LOCAL_DATA_PARALLEL,
        data_parallel=LOCAL_DATA_PARALLEL,
    )
    optimizer = keras_tp.CoordinatedOptimizer(
        make_optimizer(kind), local_sgd_steps=steps, outer_optimizer=outer
    )
    tp.compile(optimizer=optimizer, loss=loss_fn())
    return tp


def _data_optimizer_bytes(tp, phase="train"):
    """`{kind: bytes}` the optimizer sent over `data` in the last step."""
    stats = tp.communication_stats(phase, axis="data")
    return {
        kind: entry["optimizer_bytes"]
        for kind, entry in stats.items()
        if entry["optimizer_bytes"]
    }


def _largest_bytes(tp):
    """`[parameter, gradient, optimizer]` bytes of the fullest device."""
    info = tp.get_gradient_sharding_info()
    return [
        max(info[key].values())
        for key in ("parameter_bytes", "gradient_bytes", "optimizer_bytes")
    ]


def local_sgd_runs():
    """Every local SGD check on 2 data ranks, as plain numbers.

    - `local`: SGD with momentum, `local_sgd_steps=2`: two steps by
      `train_on_batch`, then `fit()` on one more batch, which ends with
      the synchronisation its last step lacked;
    - `diloco`: an outer Nesterov SGD over 2 rounds of 2 steps;
    - `ddp`: `local_sgd_steps=1` with SGD, which averages the parameters
      after every step: DDP's update, for an optimizer linear in the
      gradients.

    Returns:
        A dict of JSON-able results, checked by `check_local_sgd_runs`.
    """
    results = {
        "psi": sum(v.numpy().nbytes for v in models.mlp().trainable_variables)
    }
    x, y = models.data_for("mlp", batch=3 * BATCH)
    tp = _local_sgd_model("sgd", 2)
    results["step_bytes"] = []
    for step in range(2):
        batch = slice(step * BATCH, (step + 1) * BATCH)
        tp.train_on_batch(x[batch], y[batch])
        results["step_bytes"].append(_data_optimizer_bytes(tp))
        if step == 0:
            # The replicas stepped alone: their parameters differ.
            consistency = tp.check_gradient_consistency()
            results["between_syncs"] = consistency["consistent"]
    tp.fit(x[2 * BATCH :], y[2 * BATCH :], batch_size=BATCH, verbose=0)
    results["step_bytes"].append(_data_optimizer_bytes(tp))
    results["final_sync_bytes"] = _data_optimizer_bytes(tp, "final_sync")
    results["synchronises"] = [
        tp.optimizer.is_synchronisation_step(step) for step in (1, 2, 3, 4)
    ]
    results["local"] = max_diff(
        local_sgd_reference(x, y, "sgd", [2, 1]), tp.get_weights()
    )
    results["local_consistency"] = tp.check_gradient_consistency()
    results["info"] = {
        key: tp.get_gradient_sharding_info()[key]
        for key in ("local_sgd_steps", "outer_optimizer", "overlap")
    }
    results["memory"] = _largest_bytes(tp)

    def nesterov():
        return keras.optimizers.SGD(0.7, momentum=0.9, nesterov=True)

    x, y = models.data_for("mlp", batch=4 * BATCH, seed=2)
    tp = _local_sgd_model("sgd", 2, nesterov())
    tp.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    results["diloco"] = max_diff(
        local_sgd_reference(x, y, "sgd", [2, 2], nesterov()), tp.get_weights()
    )
    results["diloco_final_sync"] = _data_optimizer_bytes(tp, "final_sync")
    results["diloco_memory"] = _largest_bytes(tp)

    x, y = models.data_for("mlp", batch=2 * BATCH, seed=3)
    tp = _local_sgd_model("sgd", 1)
    tp.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    reference = models.mlp()
    reference.compile(
        optimizer=make_optimizer("sgd"), loss=loss_fn(), run_eagerly=True
    )
    reference.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    results["ddp"] = max_diff(reference.get_weights(), tp.get_weights())
    results["errors"] = local_sgd_errors()
    return results


def local_sgd_errors():
    """The messages of the arguments local SGD refuses, by case."""
    sgd = keras.optimizers.SGD
    cases = {
        "steps": lambda: keras_tp.CoordinatedOptimizer(
            sgd(), local_sgd_steps=0
        ),
        "zero": lambda: keras_tp.CoordinatedOptimizer(
            sgd(), zero_stage=1, local_sgd_steps=2
        ),
        "compression": lambda: keras_tp.CoordinatedOptimizer(
            sgd(), local_sgd_steps=2, compression="bf16"
        ),
        "accumulation": lambda: keras_tp.CoordinatedOptimizer(
            sgd(), local_sgd_steps=2, gradient_accumulation_steps=2
        ),
        "ema": lambda: keras_tp.CoordinatedOptimizer(
            sgd(use_ema=True), local_sgd_steps=2
        ),
        "outer_alone": lambda: keras_tp.CoordinatedOptimizer(
            sgd(), outer_optimizer=sgd()
        ),
        "outer_options": lambda: keras_tp.CoordinatedOptimizer(
            sgd(), local_sgd_steps=2, outer_optimizer=sgd(clipnorm=1.0)
        ),
        "no_data_axis": lambda: keras_tp.TensorParallelKeras(
            models.mlp(), world_size=2
        ).compile(
            optimizer=keras_tp.CoordinatedOptimizer(sgd(), local_sgd_steps=2),
            loss=loss_fn(),
        ),
    }
    errors = {}
    for name, make in cases.items():
        try:
            make()
        except (TypeError, ValueError) as e:
            errors[name] = str(e)
    return errors


def check_local_sgd_runs(results):
    """Asserts what `local_sgd_runs` measured.

    The replicas match replicas trained apart and synchronised; a step
    sends the parameters' bytes over `data` only when it synchronises,
    `psi / local_sgd_steps` per step on average.
    """
    psi = results["psi"]
    assert results["step_bytes"] == [{}, {"all_reduce": psi}, {}], results
    assert results["final_sync_bytes"] == {"all_reduce": psi}
    assert results["synchronises"] == [False, True, False, True]
    assert not results["between_syncs"]
    assert results["local"] <= 1e-5
    consistency = results["local_consistency"]
    assert consistency["consistent"], consistency
    assert results["info"] == {
        "local_sgd_steps": 2,
        "outer_optimizer": None,
        "overlap": False,
    }
    # Each device holds its own replica once, and no gradient; SGD's
    # momentum, and DiLoCo's anchor and outer momentum, are psi each.
    scalars = 64  # step counters and learning rates
    parameters, gradients, optimizer = results["memory"]
    assert parameters == psi and gradients == 0
    assert psi <= optimizer <= psi + scalars
    parameters, gradients, optimizer = results["diloco_memory"]
    assert parameters == psi and gradients == 0
    assert 3 * psi <= optimizer <= 3 * psi + scalars
    assert results["diloco"] <= 1e-5
    # Its fit() ended on a synchronisation step: nothing more to send.
    assert results["diloco_final_sync"] == {}
    assert results["ddp"] <= 1e-5
    errors = results["errors"]
    expected = {
        "steps": "local_sgd_steps must be an integer >= 1",
        "zero": "local_sgd_steps needs zero_stage=0",
        "compression": "does not apply to local SGD",
        "accumulation": "gradient_accumulation_steps does not apply",
        "ema": "use_ema=True",
        "outer_alone": "pass local_sgd_steps with it",
        "outer_options": "['clipnorm']",
        "no_data_axis": "data_parallel > 1",
    }
    assert set(errors) == set(expected), errors
    for name, piece in expected.items():
        assert piece in errors[name], (name, errors[name])


def check_gradient_accumulation(zero_stage):
    """2 micro-batches per update on 2 data ranks: one device's step on
    their union, and the buffers each rank keeps for them."""
    reference, tp, _, _ = train_pair(
        "mlp", 2, 2, zero_stage, "sgd", gradient_accumulation_steps=2
    )
    assert max_diff(reference.get_weights(), tp.get_weights()) <= 1e-5
    # The buffers are zero again after each update; under ZeRO-2 their
    # copies are compared too.
    assert tp.check_gradient_consistency()["consistent"]
    psi = sum(
        keras.ops.convert_to_numpy(v.value).nbytes
        for v in reference.trainable_variables
    )
    _, gradients, _ = kept_bytes(psi, 2, zero_stage, 2)
    assert set(tp.gradient_bytes_per_device().values()) == {gradients}


def loss_scale_overflow(world_size, data_parallel):
    """`mixed_float16` training whose first batch overflows in its last
    sample only, so on one data-parallel row: the step is skipped and the
    loss scale halved on every rank, as on one device, and the next steps
    match one device's.

    Returns:
        `{"global", "difference", "scales"}`: whether the compiled
        optimizer decides over every rank (`GlobalLossScaleOptimizer`),
        the largest weight difference from one device, and the dynamic
        scale of one device and of the mesh.
    """
    policy = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        reference = models.mlp()
        tp = keras_tp.TensorParallelKeras(
            models.mlp(), world_size=world_size, data_parallel=data_parallel
        )
        x, y = models.data_for("mlp", batch=3 * BATCH)
        # Past float16's largest value: inf in the first layer's inputs.
        x[BATCH - 1] = 1e5
        for model in (reference, tp):
            model.compile(optimizer=keras.optimizers.Adam(1e-2), loss=loss_fn())
            model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
        return {
            "global": isinstance(tp.optimizer, GlobalLossScaleOptimizer),
            "difference": max_diff(reference.get_weights(), tp.get_weights()),
            "scales": [
                float(keras.ops.convert_to_numpy(m.optimizer.dynamic_scale))
                for m in (reference, tp)
            ],
        }
    finally:
        keras.mixed_precision.set_global_policy(policy)


def check_loss_scale_overflow(result):
    assert result["global"], result
    # 32768 at the start, halved once, on one device and on every rank.
    assert result["scales"] == [16384.0, 16384.0], result
    assert result["difference"] < 2e-3, result
