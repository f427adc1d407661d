"""`python -m keras_tp.demo`: a transformer LM trained tensor-parallel.

Trains the same small transformer language model twice, on one device and
split over N virtual CPU devices (or real accelerators), and prints the
plan, the parameter bytes per device, the collectives of one training step
and both losses side by side.
"""

import argparse
import os
import sys

BACKENDS = ("jax", "torch", "tensorflow")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m keras_tp.demo",
        description="Train a small transformer LM with tensor parallelism "
        "and compare it with the same model on one device.",
    )
    parser.add_argument(
        "--devices",
        type=int,
        default=4,
        help="tensor-parallel ranks (default 4)",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        default=os.environ.get("KERAS_BACKEND", "jax"),
        help="Keras backend (default: $KERAS_BACKEND, else jax)",
    )
    parser.add_argument(
        "--epochs", type=int, default=5, help="epochs (default 5)"
    )
    parser.add_argument(
        "--samples",
        type=int,
        default=512,
        help="training sequences (default 512)",
    )
    return parser.parse_args(argv)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if os.environ.get("KERAS_BACKEND") != args.backend:
        # Keras reads KERAS_BACKEND once, when keras_tp's own import loads
        # it, so a different backend needs a fresh interpreter.
        env = {**os.environ, "KERAS_BACKEND": args.backend}
        os.execve(
            sys.executable, [sys.executable, "-m", "keras_tp.demo", *argv], env
        )
    import keras_tp

    keras_tp.configure_virtual_devices(args.devices)
    import keras
    from keras.src.utils.io_utils import print_msg

    from keras_tp.demo.models import counting_sequences
    from keras_tp.demo.models import transformer_lm

    x, y = counting_sequences(args.samples)
    single = transformer_lm()
    parallel = keras_tp.TensorParallelKeras(
        transformer_lm(), world_size=args.devices
    )
    print_msg(
        f"Backend: {keras.backend.backend()}, "
        f"devices: {parallel.get_parallelism_info()['devices']}"
    )
    parallel.summary()
    for model in (single, parallel):
        model.compile(
            optimizer=keras.optimizers.Adam(3e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    fit_args = dict(
        x=x, y=y, batch_size=32, epochs=args.epochs, shuffle=False, verbose=0
    )
    single_history = single.fit(**fit_args).history
    parallel_history = parallel.fit(**fit_args).history

    print_msg("\nCollectives in one training step (per rank):")
    for kind, stats in parallel.communication_stats().items():
        print_msg(
            f"  {kind:12} forward {stats['forward_calls']:3} calls "
            f"{stats['forward_bytes']:>9,} B   "
            f"backward {stats['backward_calls']:3} "
            f"calls {stats['backward_bytes']:>9,} B"
        )
    info = parallel.get_parallelism_info()
    total = info["parameter_bytes_total"]
    print_msg("\nParameter bytes per device:")
    print_msg(f"  one device: {total:,}")
    for device, nbytes in info["parameter_bytes_per_device"].items():
        print_msg(f"  {device}: {nbytes:,} ({nbytes / total:.0%})")

    print_msg(
        f"\n{'epoch':>5} {'loss, 1 device':>15} "
        f"{f'loss, TP={args.devices}':>15} {'|diff|':>9}"
    )
    for epoch, (a, b) in enumerate(
        zip(single_history["loss"], parallel_history["loss"]), 1
    ):
        print_msg(f"{epoch:>5} {a:>15.6f} {b:>15.6f} {abs(a - b):>9.2e}")
    weight_diff = max(
        abs(a - b).max()
        for a, b in zip(single.get_weights(), parallel.get_weights())
    )
    print_msg(f"Max |weight difference| after training: {weight_diff:.2e}")


if __name__ == "__main__":
    main()
