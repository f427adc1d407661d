"""How much of DDP's gradient communication the backward pass hides (torch).

Trains an MLP of `--layers` Dense layers of width `--width` on 2 torch
ranks (DDP, SGD) three ways and prints the mean step time of each:

- overlap: each bucket piece's all-reduce starts during the backward pass
  (`CoordinatedOptimizer(overlap=True)`, the default);
- after backward: every piece is sent by the optimizer, after the
  backward pass (`overlap=False`);
- no communication: the data axis' all-reduces return their input (the
  adapter's `communicate` debug switch; the results are wrong).

The hidden share is (after backward - overlap) / (after backward - no
communication): the part of the communication time overlap took off the
step.

    KERAS_BACKEND=torch python benchmarks/gradient_overlap.py
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras_tp  # noqa: E402

RANKS = 2
BATCH = 64
MODES = ("overlap", "after backward", "no communication")


def step_times(width, layers, steps, bucket_mb):
    """Mean seconds per training step of each mode, on this rank."""
    import keras
    import numpy as np

    class StepTimer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.times.append(time.perf_counter() - self.start)

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * steps, width)).astype("float32")
    y = rng.integers(0, 10, BATCH * steps)
    results = {}
    for mode in MODES:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((width,))]
            + [
                keras.layers.Dense(width, activation="relu")
                for _ in range(layers)
            ]
            + [keras.layers.Dense(10)]
        )
        tp = keras_tp.TensorParallelKeras(
            model, world_size=RANKS, data_parallel=RANKS
        )
        optimizer = keras_tp.CoordinatedOptimizer(
            keras.optimizers.SGD(1e-3),
            bucket_cap_mb=bucket_mb,
            overlap=mode == "overlap",
        )
        tp.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        tp._runtime.data_adapter.communicate = mode != "no communication"
        timer = StepTimer()
        timer.times = []
        tp.fit(
            x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[timer]
        )
        # The first steps build and warm up; time the rest.
        results[mode] = float(np.median(timer.times[steps // 4 :]))
    return results


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    args = parser.parse_args(argv)
    # Rank 0's times (launch returns what rank 0 returns).
    times = keras_tp.launch(
        step_times,
        world_size=RANKS,
        args=(args.width, args.layers, args.steps, args.bucket_mb),
    )
    after, overlap, none = (
        times["after backward"],
        times["overlap"],
        times["no communication"],
    )
    hidden = (after - overlap) / (after - none) if after > none else 0.0
    params = (args.width * args.width + args.width) * args.layers
    print(
        f"MLP {args.layers} x {args.width} ({params / 1e6:.1f} M parameters), "
        f"{RANKS} torch ranks (gloo), bucket_cap_mb={args.bucket_mb}"
    )
    print("| mode | ms per step |")
    print("|---|---:|")
    for mode in MODES:
        print(f"| {mode} | {1e3 * times[mode]:.1f} |")
    print(f"hidden share of the communication: {hidden:.0%}")


if __name__ == "__main__":
    main()
