"""Item 9: a straggler, against synchronous DDP, async SGD and local SGD.

Two workers on torch, one of them 3x slower than the other, train the
same MLP on the same samples (a teacher network's classes) three ways:

- **DDP**: `TensorParallelKeras(model, world_size=2, data_parallel=2)`
  and Keras' `fit()`: every step waits for both ranks' gradients.
- **local SGD**: the same, compiled with `CoordinatedOptimizer(optimizer,
  local_sgd_steps=H)`: each rank steps alone and the ranks average their
  parameters every `H` steps.
- **async**: `AsyncDataParallel(model, workers=2, servers=1,
  max_staleness=K)`, 3 processes: the next free worker takes the next
  slice, and the fast one runs up to `K` updates ahead of the slow one.

A worker's step computes on 16 samples (DDP's and local SGD's rank
share of a 32-sample batch, async's slice of one). Its compute is
simulated by a sleep in a layer of the model, `step_seconds` on worker 0
and 3x that on worker 1: with a real compute of that length, 3 processes
would share this machine's 2 cores, and the measure would be of the
contention for them rather than of the straggler. The real compute of the
step (a few milliseconds) comes on top, on every worker.

Measured, per run, on rank 0 (worker 0): the wall-clock from `fit()`'s
start to each epoch's end, with the epoch's mean training loss, and the
loss on held-out samples after the run (a fixed number of samples for
every mode). The target loss is the one DDP's curve reaches after half
its samples, in the same round; the time to reach it is interpolated
between epoch ends. Launches alternate between the 2-rank job (DDP, local
SGD) and the 3-rank one (async), round by round, and the ratios are the
median over the rounds.

    KERAS_BACKEND=torch python benchmarks/straggler.py [--json PATH]
"""

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_tp  # noqa: E402
from benchmarks import report  # noqa: E402
from benchmarks.timing import comparison  # noqa: E402
from benchmarks.timing import spread  # noqa: E402

# The worker (rank) that is slow, and by how much.
SLOW_RANK = 1
SLOWDOWN = 3
MODES = ("DDP", "local SGD", "async")
# How much higher than DDP's a mode's held-out loss may end.
LOSS_MARGIN = 0.1

SETTINGS = dict(
    features=32,
    hidden=128,
    classes=8,
    samples=512,
    batch=32,
    epochs=12,
    learning_rate=0.05,
    step_seconds=0.02,
    local_sgd_steps=4,
    max_staleness=4,
)
# Sizes of tests/test_torch_straggler.py: seconds of training per mode.
QUICK_SETTINGS = dict(SETTINGS, samples=256, epochs=4)


class SimulatedCompute(keras.layers.Layer):
    """Sleeps in every training step: the compute of a worker's step.

    Args:
        seconds: the step's compute on a worker of normal speed.
        slow_rank: the rank whose steps take `slowdown` times as long.
        slowdown: how much slower that rank is.
    """

    def __init__(self, seconds, slow_rank, slowdown, **kwargs):
        super().__init__(**kwargs)
        self.seconds = seconds
        self.slow_rank = slow_rank
        self.slowdown = slowdown

    def call(self, inputs, training=None):
        if training:
            slow = int(os.environ.get("RANK", 0)) == self.slow_rank
            time.sleep(self.seconds * (self.slowdown if slow else 1))
        return inputs


def build_model(settings):
    """The MLP with its simulated compute, seeded by its initializers."""
    inputs = keras.Input((settings["features"],))
    x = SimulatedCompute(settings["step_seconds"], SLOW_RANK, SLOWDOWN)(inputs)
    for seed in (1, 2):
        x = keras.layers.Dense(
            settings["hidden"],
            activation="relu",
            kernel_initializer=keras.initializers.GlorotUniform(seed=seed),
        )(x)
    outputs = keras.layers.Dense(
        settings["classes"],
        kernel_initializer=keras.initializers.GlorotUniform(seed=3),
    )(x)
    return keras.Model(inputs, outputs, name="straggler_mlp")


def teacher_data(samples, features, classes, seed):
    """`(x, y)`: Gaussian inputs labelled by a random two-layer network."""
    teacher = np.random.default_rng(0)
    hidden = teacher.normal(size=(features, 64)) / np.sqrt(features)
    head = teacher.normal(size=(64, classes)) / 8.0
    x = np.random.default_rng(seed).normal(size=(samples, features))
    y = np.argmax(np.tanh(x @ hidden) @ head, axis=-1)
    return x.astype("float32"), y.astype("int32")


class LossCurve(keras.callbacks.Callback):
    """`(seconds since fit() began, samples, epoch loss)` at epoch ends."""

    def __init__(self, samples_per_epoch):
        super().__init__()
        self.samples_per_epoch = samples_per_epoch
        self.points = []

    def on_train_begin(self, logs=None):
        self.start = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.points.append(
            (
                time.perf_counter() - self.start,
                (epoch + 1) * self.samples_per_epoch,
                float(logs["loss"]),
            )
        )


def _train(trainer, settings, optimizer):
    """Fits `trainer`; its loss curve and held-out loss."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    trainer.compile(optimizer=optimizer, loss=loss)
    sizes = (settings["features"], settings["classes"])
    x, y = teacher_data(settings["samples"], *sizes, seed=1)
    x_test, y_test = teacher_data(1024, *sizes, seed=2)
    curve = LossCurve(settings["samples"])
    trainer.fit(
        x,
        y,
        batch_size=settings["batch"],
        epochs=settings["epochs"],
        shuffle=False,
        callbacks=[curve],
        verbose=0,
    )
    held_out = trainer.evaluate(x_test, y_test, batch_size=256, verbose=0)
    return {"curve": curve.points, "final_loss": float(held_out)}


def synchronous_ranks(settings, modes):
    """DDP and local SGD (those of `modes`) on the 2 ranks of a launch;
    rank 0's runs."""
    runs = {}
    for mode in modes:
        model = keras_tp.TensorParallelKeras(
            build_model(settings), world_size=2, data_parallel=2
        )
        optimizer = keras.optimizers.SGD(settings["learning_rate"])
        if mode == "local SGD":
            optimizer = keras_tp.CoordinatedOptimizer(
                optimizer, local_sgd_steps=settings["local_sgd_steps"]
            )
        runs[mode] = _train(model, settings, optimizer)
    return runs


def asynchronous_ranks(settings):
    """AsyncDataParallel on 2 workers and 1 server; rank 0's run."""
    trainer = keras_tp.AsyncDataParallel(
        build_model(settings),
        workers=2,
        servers=1,
        max_staleness=settings["max_staleness"],
    )
    run = _train(
        trainer, settings, keras.optimizers.SGD(settings["learning_rate"])
    )
    run["staleness_histogram"] = trainer.staleness_histogram()
    return {"async": run}


def time_to_loss(curve, target):
    """Seconds until the curve first reaches `target`, or `None`.

    Interpolated linearly between the epoch ends around the crossing (from
    fit()'s start, at the first epoch's loss, for the first epoch).
    """
    before_time, before_loss = 0.0, None
    for seconds, _, loss in curve:
        if loss <= target:
            if before_loss is None or before_loss == loss:
                return seconds
            share = (before_loss - target) / (before_loss - loss)
            return before_time + share * (seconds - before_time)
        before_time, before_loss = seconds, loss
    return None


def measure(settings, rounds, modes=MODES, progress=None, timeout=900):
    """Runs `rounds` rounds of the launches; every run, by mode.

    Args:
        settings: `SETTINGS` or `QUICK_SETTINGS`.
        rounds: how many times each mode runs.
        modes: the modes to run; DDP always runs, for the target.
        progress: optional callable taking the fraction of rounds done.
        timeout: seconds before `launch` stops a job's ranks.

    Returns:
        `{mode: [run per round]}`; each run has its `curve`,
        `final_loss`, `target` (from DDP's curve of its round) and
        `time_to_target`.
    """
    synchronous = [m for m in ("DDP", "local SGD") if m == "DDP" or m in modes]
    launches = [(synchronous_ranks, 2, (settings, synchronous))]
    if "async" in modes:
        launches.append((asynchronous_ranks, 3, (settings,)))
    ran = synchronous + ["async"] * ("async" in modes)
    runs = {mode: [] for mode in ran}
    for round_index in range(rounds):
        results = {}
        # The order alternates, so that neither launch always runs first.
        for function, world_size, args in (
            launches if round_index % 2 == 0 else launches[::-1]
        ):
            results.update(
                keras_tp.launch(
                    function, world_size=world_size, args=args, timeout=timeout
                )
            )
        ddp_curve = results["DDP"]["curve"]
        target = ddp_curve[len(ddp_curve) // 2 - 1][2]
        for mode in ran:
            run = results[mode]
            run["target"] = target
            run["time_to_target"] = time_to_loss(run["curve"], target)
            runs[mode].append(run)
        if progress is not None:
            progress((round_index + 1) / rounds)
    return runs


def rows_of(runs, settings):
    """The comparison rows: each mode against DDP, wall-clock and loss."""
    rows = []
    samples = settings["samples"] * settings["epochs"]
    for mode in ("async", "local SGD"):
        pairs = list(zip(runs[mode], runs["DDP"]))
        label = _label(mode, settings)
        rows.append(
            comparison(
                f"{label}: wall-clock for {samples} samples",
                "DDP=2, the same straggler",
                spread(
                    [r["curve"][-1][0] / d["curve"][-1][0] for r, d in pairs]
                ),
                goal=("<=", 1.0),
            )
        )
        reached = [
            r["time_to_target"] / d["time_to_target"]
            for r, d in pairs
            if r["time_to_target"] is not None
        ]
        if reached:
            rows.append(
                comparison(
                    f"{label}: wall-clock to the target loss",
                    "DDP=2, the same straggler",
                    spread(reached),
                    goal=("<=", 1.0),
                    note=(
                        f"reached in {len(reached)} of {len(pairs)} rounds; "
                        "target: DDP's loss after half its samples"
                    ),
                )
            )
        rows.append(
            comparison(
                f"{label}: held-out loss after {samples} samples",
                "DDP=2",
                spread([r["final_loss"] / d["final_loss"] for r, d in pairs]),
                goal=("<=", 1.0 + LOSS_MARGIN),
                note="lower is better; the margin is one-sided",
            )
        )
    return rows


def _label(mode, settings):
    if mode == "async":
        return f"async, 2 workers + 1 server, K={settings['max_staleness']}"
    return f"local SGD=2, H={settings['local_sgd_steps']}"


def summary(runs):
    """Per mode: medians of its seconds and loss, and of their ratios to
    DDP's round by round."""
    table = {}
    for mode, mode_runs in runs.items():
        pairs = list(zip(mode_runs, runs["DDP"]))
        reached = [
            (r["time_to_target"], r["time_to_target"] / d["time_to_target"])
            for r, d in pairs
            if r["time_to_target"] is not None
        ]
        table[mode] = {
            "run_s": statistics.median(r["curve"][-1][0] for r in mode_runs),
            "run_vs_ddp": statistics.median(
                r["curve"][-1][0] / d["curve"][-1][0] for r, d in pairs
            ),
            "reached": f"{len(reached)}/{len(mode_runs)}",
            "time_to_target_s": (
                statistics.median(s for s, _ in reached) if reached else None
            ),
            "time_to_target_vs_ddp": (
                statistics.median(v for _, v in reached) if reached else None
            ),
            "final_loss": statistics.median(r["final_loss"] for r in mode_runs),
            "final_loss_vs_ddp": statistics.median(
                r["final_loss"] / d["final_loss"] for r, d in pairs
            ),
            "target": statistics.median(r["target"] for r in mode_runs),
        }
    return table


def run(progress, rounds=3, quick=False, timeout=900):
    """The suite's task: `{"rows": [...], "data": {...}}`.

    Args:
        progress: callable taking the fraction of the work done.
        rounds: rounds of the two launches.
        quick: the test's sizes.
        timeout: seconds before `launch` stops a job's ranks.
    """
    settings = QUICK_SETTINGS if quick else SETTINGS
    runs = measure(settings, rounds, progress=progress, timeout=timeout)
    return {
        "rows": rows_of(runs, settings),
        "data": {
            "settings": settings,
            "slow_rank": SLOW_RANK,
            "slowdown": SLOWDOWN,
            "summary": summary(runs),
            "runs": runs,
        },
    }


def markdown_table(table, settings):
    """The summary as the Markdown table of docs/guides/async.md."""
    names = {"DDP": "DDP=2"}
    lines = [
        "| mode | whole run | vs DDP | time to target | vs DDP "
        "| held-out loss | vs DDP |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        row = table[mode]
        if row["time_to_target_s"] is None:
            to_target = f"not reached ({row['reached']}) |"
        else:
            to_target = (
                f"{row['time_to_target_s']:.2f} s ({row['reached']}) | "
                f"{row['time_to_target_vs_ddp']:.2f}x"
            )
        lines.append(
            f"| {names.get(mode) or _label(mode, settings)} | "
            f"{row['run_s']:.2f} s | {row['run_vs_ddp']:.2f}x | {to_target} "
            f"| {row['final_loss']:.3f} | {row['final_loss_vs_ddp']:.3f}x |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", help="path of a JSON file to write")
    args = parser.parse_args(argv)
    result = run(None, rounds=args.rounds, quick=args.quick)
    print(markdown_table(result["data"]["summary"], result["data"]["settings"]))
    if args.json:
        result.update(
            machine=report.machine(),
            versions=report.versions(),
            command=" ".join(["python", *sys.argv]),
        )
        with open(args.json, "w") as file:
            json.dump(result, file, indent=1)


if __name__ == "__main__":
    main()
