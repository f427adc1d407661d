"""Compressed data-parallel runs shared by every backend's tests.

The runs use keras_tp's public API only, so JAX and TensorFlow call them in
the test process and torch on every rank of one launch. The bytes each
kind sends are written out by hand from the MLP's shapes, not read from
keras_tp.
"""

import math

import keras
import numpy as np

import keras_tp
from keras_tp.parallel.compression import WARMUP_STEPS
from tests import models
from tests.models import loss_fn
from tests.models import max_diff

STEPS = 4
NEXT_STEPS = 2
BATCH = 8
KINDS = ("bf16", "fp16", "powersgd", "sign")
POWERSGD_RANK = 2
# The MLP of `tests.models.mlp`: up, down and head kernels and biases.
MLP_SHAPES = [(16, 32), (32,), (32, 32), (32,), (32, 8), (8,)]
# bf16 keeps 8 bits of mantissa: after `STEPS` SGD steps the weights are
# within this of the uncompressed run's (measured: 1e-5 to 4e-5; fp16 less).
CAST_TOLERANCE = 2e-4


def compression_of(kind, warmup_steps=0):
    """The `compression` argument a run of `kind` uses: compressed from
    the first step unless a warm-up is asked for."""
    if kind == "powersgd":
        return keras_tp.Compression(
            "powersgd", rank=POWERSGD_RANK, warmup_steps=warmup_steps
        )
    if kind == "sign":
        return keras_tp.Compression("sign", warmup_steps=warmup_steps)
    return kind


def parallel(kind, world_size, data_parallel, zero_stage, warmup_steps=0):
    """The MLP on a `data x model` mesh, compiled with SGD and `kind`."""
    tp = keras_tp.TensorParallelKeras(
        models.mlp(),
        world_size=world_size,
        data_parallel=data_parallel,
        zero_stage=zero_stage,
    )
    optimizer = keras_tp.CoordinatedOptimizer(
        keras.optimizers.SGD(0.05),
        zero_stage=zero_stage,
        compression=compression_of(kind, warmup_steps),
    )
    tp.compile(optimizer=optimizer, loss=loss_fn())
    return tp


def data(samples):
    return models.data_for("mlp", batch=samples, seed=3)


def train(kind, layout):
    """`STEPS` steps of the MLP at `layout` (world, data, ZeRO stage).

    Returns:
        `(weights, {collective: optimizer bytes of one step over data})`.
    """
    tp = parallel(kind, *layout)
    x, y = data(STEPS * BATCH)
    tp.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    report = tp.check_gradient_consistency()
    assert report["consistent"], (kind, layout, report)
    sent = {
        collective: entry["optimizer_bytes"]
        for collective, entry in tp.communication_stats(axis="data").items()
        if entry["optimizer_bytes"]
    }
    return tp.get_weights(), sent


def expected_traffic(kind, data_parallel, zero_stage):
    """The bytes one step of the MLP hands to the data axis' collectives.

    Uncompressed, DDP all-reduces psi, ZeRO-1/2 reduce-scatter psi and
    all-gather the updated parameters (psi). bf16 and fp16 halve what is
    reduced. PowerSGD all-reduces P (n x r) and Q (m x r) of each kernel
    worth compressing ((n + m) r <= n m / 2) and the rest whole. Signs
    are 32 to an int32 word plus a float32 scale per tensor, all-gathered
    from every rank.
    """
    sizes = [math.prod(shape) for shape in MLP_SHAPES]
    psi = 4 * sum(sizes)
    gathered = {"all_gather": psi} if zero_stage else {}
    reduced = "reduce_scatter" if zero_stage else "all_reduce"
    if kind is None:
        return {reduced: psi, **gathered}
    if kind in ("bf16", "fp16"):
        return {reduced: psi // 2, **gathered}
    if kind == "powersgd":
        floats = 0
        for shape in MLP_SHAPES:
            compressed = len(shape) == 2 and (
                2 * (shape[0] + shape[1]) * POWERSGD_RANK <= math.prod(shape)
            )
            floats += (
                (shape[0] + shape[1]) * POWERSGD_RANK
                if compressed
                else math.prod(shape)
            )
        return {"all_reduce": 4 * floats, **gathered}
    words = math.ceil(sum(sizes) / 32)
    signs = data_parallel * (4 * words + 4 * len(MLP_SHAPES))
    return {"all_gather": signs + gathered.get("all_gather", 0)}


def warmup_run(kind, warmup_steps=2, layout=(2, 2, 0)):
    """`kind` after a warm-up, read step by step against uncompressed.

    One `fit()` runs every step; a callback reads the stats, the
    compression state and the weights after each, mid-epoch, as a user's
    callback would (Keras' JAX trainer keeps the state apart there), and
    trains the uncompressed model one step.

    Returns:
        Per step: `(sent, at_start, same_weights)`, the optimizer bytes
        of the step over `data` by collective, whether the compression
        state (errors, `Q`s) is still its first value, and whether the
        weights equal those of uncompressed training.
    """
    tp = parallel(kind, *layout, warmup_steps=warmup_steps)
    plain = parallel(None, *layout)
    x, y = data(STEPS * BATCH)
    steps = []
    first_state = []

    class EveryStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            rows = slice(batch * BATCH, (batch + 1) * BATCH)
            plain.train_on_batch(x[rows], y[rows])
            sent = {
                collective: entry["optimizer_bytes"]
                for collective, entry in tp.communication_stats(
                    axis="data"
                ).items()
                if entry["optimizer_bytes"]
            }
            same = max_diff(tp.get_weights(), plain.get_weights()) <= 1e-6
            compression = tp.optimizer.compression_variables
            state = [tp._runtime.placement.full_value(v) for v in compression]
            if not first_state:
                first_state.extend(
                    np.zeros_like(v) if "error" in variable.name else v
                    for v, variable in zip(state, compression)
                )
            at_start = max_diff(state, first_state) == 0
            steps.append((sent, at_start, same))

    tp.fit(
        x,
        y,
        batch_size=BATCH,
        shuffle=False,
        verbose=0,
        callbacks=[EveryStep()],
    )
    return steps


def momentum_signs_run(optimizer, warmup_steps=2, layout=(2, 2, 0)):
    """The inner optimizer's slots after each step of a run whose signs
    start after `warmup_steps`: Adam's momenta and second moments, or
    SGD's momenta (`optimizer`: `"adam"` or `"sgd"`, with momentum).

    Returns:
        Per step, `{slot list's name: [full value of each slot]}`.
    """
    if optimizer == "adam":
        inner, slots = (
            keras.optimizers.Adam(1e-2),
            ("_momentums", "_velocities"),
        )
    else:
        inner, slots = keras.optimizers.SGD(0.05, momentum=0.9), ("momentums",)
    tp = keras_tp.TensorParallelKeras(
        models.mlp(), world_size=layout[0], data_parallel=layout[1]
    )
    tp.compile(
        optimizer=keras_tp.CoordinatedOptimizer(
            inner, compression=compression_of("sign", warmup_steps)
        ),
        loss=loss_fn(),
    )
    steps = []

    class EveryStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            # Reading `self.model` brings Keras' JAX state back to it.
            full = self.model._runtime.placement.full_value
            steps.append(
                {
                    name: [full(v) for v in getattr(inner, name)]
                    for name in slots
                }
            )

    x, y = data(STEPS * BATCH)
    tp.fit(
        x,
        y,
        batch_size=BATCH,
        shuffle=False,
        verbose=0,
        callbacks=[EveryStep()],
    )
    return steps


def check_momentum_signs(steps, warmup_steps=2):
    """The momenta move at every update; Adam's second moments move in
    the warm-up and then stay as it left them, while signs of each rank's
    next momentum travel (1-bit Adam)."""
    for number in range(1, len(steps)):
        before, after = steps[number - 1], steps[number]
        for name in after:
            moved = max_diff(after[name], before[name]) > 0
            # Update `number + 1` is compressed.
            frozen = name == "_velocities" and number >= warmup_steps
            assert moved != frozen, (name, number + 1, moved)


def check_warmup(kind, steps, warmup_steps=2, data_parallel=2):
    """The warm-up sends uncompressed and keeps the state at its start;
    the steps after it send compressed and move the state."""
    for number, (sent, at_start, same) in enumerate(steps, start=1):
        warming = number <= warmup_steps
        expected = expected_traffic(None if warming else kind, data_parallel, 0)
        assert sent == expected, (kind, number, sent, expected)
        assert at_start == warming, (kind, number, at_start)
        assert same == warming, (kind, number, same)


def next_losses(tp):
    """The losses of the `NEXT_STEPS` steps after the first `STEPS`."""
    x, y = data((STEPS + NEXT_STEPS) * BATCH)
    first = STEPS * BATCH
    history = tp.fit(
        x[first:], y[first:], batch_size=BATCH, shuffle=False, verbose=0
    )
    return history.history["loss"]


def resume_run(kind, directory, layout, lose_state=False):
    """Losses after a checkpoint: uninterrupted, resumed, and state lost.

    A run trains `STEPS` steps and saves; the next steps' losses of that
    run and of a new model that loads the checkpoint must agree. With
    `lose_state`, a third model loads it and zeroes the compression's
    state, which must show in its losses.

    Returns:
        `(uninterrupted, resumed, lost)`, lost `None` without `lose_state`.
    """
    tp = parallel(kind, *layout)
    x, y = data(STEPS * BATCH)
    tp.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    keras_tp.save_checkpoint(tp, directory, epoch=1)
    uninterrupted = next_losses(tp)
    resumed = parallel(kind, *layout)
    info = keras_tp.load_checkpoint(resumed, directory)
    assert info["step"] == STEPS, info
    resumed_losses = next_losses(resumed)
    lost = None
    if lose_state:
        tp = parallel(kind, *layout)
        keras_tp.load_checkpoint(tp, directory)
        for variable in tp.optimizer.compression_variables:
            variable.assign(keras.ops.zeros(variable.shape, variable.dtype))
        lost = next_losses(tp)
    return uninterrupted, resumed_losses, lost


def check_resumed(uninterrupted, resumed, lost=None):
    """The resumed run continues exactly; a lost state shows."""
    np.testing.assert_allclose(resumed, uninterrupted, rtol=0, atol=1e-6)
    if lost is not None:
        assert np.abs(np.subtract(lost, uninterrupted)).max() > 1e-4


def zero3_refused():
    """The message of compression under ZeRO-3, which is refused."""
    try:
        keras_tp.CoordinatedOptimizer(
            keras.optimizers.SGD(0.1), zero_stage=3, compression="bf16"
        )
    except ValueError as e:
        return str(e)
    raise AssertionError("compression with zero_stage=3 was accepted")


def check_zero3_message(message):
    assert "compression='bf16' does not apply to zero_stage=3" in message
    assert "Use zero_stage=2" in message


def check_config_round_trip():
    """`get_config`/`from_config` keep the compression."""
    optimizer = keras_tp.CoordinatedOptimizer(
        keras.optimizers.SGD(0.1),
        compression=keras_tp.Compression("powersgd", rank=3, seed=7),
    )
    config = optimizer.get_config()
    assert config["compression"] == {
        "kind": "powersgd",
        "rank": 3,
        "min_compression_rate": 2.0,
        "seed": 7,
        "warmup_steps": WARMUP_STEPS,
    }
    again = keras_tp.CoordinatedOptimizer.from_config(config)
    assert again.compression.get_config() == config["compression"]
    sign = keras_tp.Compression.get({"kind": "sign", "warmup_steps": 5})
    assert sign.get_config() == {"kind": "sign", "warmup_steps": 5}
    plain = keras_tp.CoordinatedOptimizer(keras.optimizers.SGD(0.1))
    assert plain.get_config()["compression"] is None


def check_traffic_and_closeness(runs):
    """Checks `{(kind, layout): train(kind, layout)}` runs.

    Every run's bytes are `expected_traffic`'s; bf16 and fp16 weights are
    close to the uncompressed run at the same layout, and PowerSGD and
    signs really changed the update.
    """
    for (kind, layout), (weights, sent) in runs.items():
        _, data_parallel, stage = layout
        if layout[0] == data_parallel:
            expected = expected_traffic(kind, data_parallel, stage)
            assert sent == expected, (kind, layout, sent, expected)
        if kind is None:
            continue
        plain_weights, plain_sent = runs[(None, layout)]
        difference = max_diff(weights, plain_weights)
        if kind in ("bf16", "fp16"):
            assert difference <= CAST_TOLERANCE, (kind, layout, difference)
            reduced = "reduce_scatter" if stage else "all_reduce"
            assert 2 * sent[reduced] == plain_sent[reduced]
        else:
            assert difference > 1e-4, (kind, layout, difference)


def rank_checks(layouts, directory):
    """What the torch test checks, run on every rank of one launch.

    Args:
        layouts: `{kind: [layout, ...]}` of the traffic runs (the
            uncompressed runs are added).
        directory: where the resume runs save, one folder per kind.
    """
    runs = {}
    for kind, kind_layouts in layouts.items():
        for layout in kind_layouts:
            for each in (None, kind):
                if (each, layout) not in runs:
                    runs[(each, layout)] = train(each, layout)
    check_traffic_and_closeness(runs)
    for kind in ("powersgd", "sign"):
        check_warmup(kind, warmup_run(kind))
    check_momentum_signs(momentum_signs_run("adam"))
    resumed = {
        kind: resume_run(
            kind,
            f"{directory}/{kind}",
            (2, 2, 0),
            lose_state=kind == "sign",
        )
        for kind in ("powersgd", "sign")
    }
    for losses in resumed.values():
        check_resumed(*losses)
    return {
        "runs": len(runs),
        "resumed": {
            k: [list(map(float, v or [])) for v in losses]
            for k, losses in resumed.items()
        },
        "zero3": zero3_refused(),
    }


def teacher_data(samples, seed=0):
    """A learnable task: classes of a random linear teacher."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 16)).astype("float32")
    teacher = rng.normal(size=(16, 8))
    return x, np.argmax(x @ teacher, axis=1)


def convergence_run(kind, epochs, data_parallel=4, warmup_steps=0):
    """Final loss of the MLP on `teacher_data`, Adam, 32 steps an epoch."""
    x, y = teacher_data(1024)
    tp = keras_tp.TensorParallelKeras(
        models.mlp(), world_size=data_parallel, data_parallel=data_parallel
    )
    optimizer = keras_tp.CoordinatedOptimizer(
        keras.optimizers.Adam(3e-3),
        compression=compression_of(kind, warmup_steps),
    )
    tp.compile(optimizer=optimizer, loss=loss_fn())
    history = tp.fit(
        x, y, batch_size=32, epochs=epochs, shuffle=False, verbose=0
    )
    return history.history["loss"]
