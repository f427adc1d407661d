"""The pipeline bubble, measured: idle time per stage of 2 stages.

Trains an MLP of `--layers` Dense layers of width `--width`, cut into 2
stages of equal parameters (`keras_tp.pipeline.split_stages`), with the
GPipe and 1F1B schedules, for each number of micro-batches in
`--microbatches`:

`TensorParallelKeras(pipeline_parallel=2)` trains it with Adam, and each
pass is timed on its stage's devices (`pipeline_timeline()`):
- torch: 2 ranks (gloo), each running its stage's passes;
- TensorFlow: 2 logical CPUs, by the traced step;
- JAX: 2 logical CPUs, by each pass's program.

The last step's times give each stage's idle share of the step
(`1 - busy / step`), printed next to the ideal `(P - 1) / (M + P - 1)`,
with the most micro-batches whose activations a stage held at once and
the bytes it sent.

    KERAS_BACKEND=torch python benchmarks/pipeline_bubble.py
    KERAS_BACKEND=tensorflow python benchmarks/pipeline_bubble.py
    KERAS_BACKEND=jax python benchmarks/pipeline_bubble.py
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import keras_tp  # noqa: E402

STAGES = 2
BATCH = 64


def mlp(width, layers):
    """The benchmark's MLP, seeded."""
    import keras

    keras.utils.set_random_seed(0)
    inputs = keras.Input((width,))
    hidden = inputs
    for i in range(layers):
        hidden = keras.layers.Dense(width, activation="relu", name=f"d{i}")(
            hidden
        )
    return keras.Model(inputs, keras.layers.Dense(10, name="head")(hidden))


def pipeline_measured(width, layers, schedule, microbatches, steps):
    """`measured`'s numbers of a `TensorParallelKeras` pipeline's last
    training step, from `pipeline_timeline()`."""
    import keras
    import numpy as np

    from keras_tp.pipeline import schedules

    tp = keras_tp.TensorParallelKeras(
        mlp(width, layers),
        world_size=STAGES,
        pipeline_parallel=STAGES,
        num_microbatches=microbatches,
        schedule=schedule,
    )
    tp.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * steps, width)).astype("float32")
    y = rng.integers(0, 10, BATCH * steps)
    tp.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    timeline = tp.pipeline_timeline()
    order = [[span.action for span in stage] for stage in timeline.spans]
    sent = tp.communication_stats("train", axis="pipe")["send"]
    return (
        schedules.bubble_fraction(timeline),
        schedules.peak_activations(order),
        # Stage 0 sends activations forward, stage 1 gradients backward.
        [sent.get("forward_bytes", 0), sent.get("backward_bytes", 0)],
    )


def ranks_measured(*run):
    """`pipeline_measured` on torch ranks, each of which counts what its
    own stage sent."""
    import torch.distributed as dist

    ranks = [None] * STAGES
    dist.all_gather_object(ranks, pipeline_measured(*run))
    bubble, peak, _ = ranks[0]
    return bubble, peak, [ranks[0][2][0], ranks[1][2][1]]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--microbatches", type=int, nargs="+", default=[2, 4, 8]
    )
    args = parser.parse_args(argv)
    import keras

    from keras_tp.pipeline import schedules

    backend = keras.backend.backend()
    if backend in ("tensorflow", "jax"):
        keras_tp.configure_virtual_devices(STAGES)
        where = f"{STAGES} logical CPUs ({backend})"
    else:
        where = f"{STAGES} torch ranks (gloo)"
    print(
        f"MLP of {args.layers} x Dense({args.width}), batch {BATCH}, "
        f"{where}, last of {args.steps} steps\n"
    )
    print(
        "| schedule | M | bubble, stage 0 / 1 | ideal | peak activations "
        "| bytes sent, stage 0 / 1 |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for schedule in ("gpipe", "1f1b"):
        for microbatches in args.microbatches:
            run = (args.width, args.layers, schedule, microbatches, args.steps)
            if backend in ("tensorflow", "jax"):
                bubble, peak, sent = pipeline_measured(*run)
            else:
                bubble, peak, sent = keras_tp.launch(
                    ranks_measured, world_size=STAGES, args=run
                )
            ideal = schedules.ideal_bubble(STAGES, microbatches)
            print(
                f"| {schedule} | {microbatches} | "
                f"{bubble[0]:.2f} / {bubble[1]:.2f} | {ideal:.2f} | "
                f"{peak[0]} / {peak[1]} | {sent[0]:,} / {sent[1]:,} |"
            )


if __name__ == "__main__":
    main()
