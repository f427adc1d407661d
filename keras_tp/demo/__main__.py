"""`python -m keras_tp.demo`: a transformer LM trained tensor-parallel.

Trains the same small transformer language model twice, on one device and
split over N devices (virtual CPU devices, real accelerators, or on torch
one process per rank), and prints the plan, the parameter bytes per device,
the collectives of one training step and both losses side by side.
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


def train_and_compare(devices, epochs, samples):
    """Trains the LM on one device and split over `devices` ranks.

    Runs on every rank (`keras_tp.launch`); returns, on each, a dict with
    the plan table, the measured bytes, the collectives and both losses.
    """
    import keras

    import keras_tp
    from keras_tp.demo.models import counting_sequences
    from keras_tp.demo.models import transformer_lm

    x, y = counting_sequences(samples)
    single = transformer_lm()
    parallel = keras_tp.TensorParallelKeras(
        transformer_lm(), world_size=devices
    )
    plan_lines = []
    parallel.summary(print_fn=plan_lines.append)
    for model in (single, parallel):
        model.compile(
            optimizer=keras.optimizers.Adam(3e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    fit_args = dict(
        x=x, y=y, batch_size=32, epochs=epochs, shuffle=False, verbose=0
    )
    single_loss = single.fit(**fit_args).history["loss"]
    parallel_loss = parallel.fit(**fit_args).history["loss"]
    output_diff = float(
        abs(single.predict(x, verbose=0) - parallel.predict(x, verbose=0)).max()
    )
    return {
        "info": parallel.get_parallelism_info(),
        "plan": "\n".join(plan_lines),
        "collectives": parallel.communication_stats(),
        "single_loss": single_loss,
        "parallel_loss": parallel_loss,
        "output_diff": output_diff,
    }


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if "keras" in sys.modules:
        import keras

        if keras.backend.backend() != args.backend:
            # Keras reads KERAS_BACKEND once, at import: another backend
            # needs a fresh interpreter.
            env = {**os.environ, "KERAS_BACKEND": args.backend}
            command = [sys.executable, "-m", "keras_tp.demo", *argv]
            os.execve(sys.executable, command, env)
    os.environ["KERAS_BACKEND"] = args.backend
    import keras_tp

    keras_tp.configure_virtual_devices(args.devices)
    from keras.src.utils.io_utils import print_msg

    report = keras_tp.launch(
        train_and_compare,
        world_size=args.devices,
        args=(args.devices, args.epochs, args.samples),
    )
    info = report["info"]
    print_msg(f"Backend: {info['backend']}, devices: {info['devices']}")
    print_msg(report["plan"])
    print_msg("\nCollectives in one training step (per rank):")
    for kind, stats in report["collectives"].items():
        print_msg(
            f"  {kind:12} forward {stats['forward_calls']:3} calls "
            f"{stats['forward_bytes']:>9,} B   "
            f"backward {stats['backward_calls']:3} "
            f"calls {stats['backward_bytes']:>9,} B"
        )
    total = info["parameter_bytes_total"]
    print_msg("\nParameter bytes per device (measured on rank 0's devices):")
    print_msg(f"  one device: {total:,}")
    for device, nbytes in info["parameter_bytes_per_device"].items():
        print_msg(f"  {device}: {nbytes:,} ({nbytes / total:.0%})")

    print_msg(
        f"\n{'epoch':>5} {'loss, 1 device':>15} "
        f"{f'loss, TP={args.devices}':>15} {'|diff|':>9}"
    )
    losses = zip(report["single_loss"], report["parallel_loss"])
    for epoch, (a, b) in enumerate(losses, 1):
        print_msg(f"{epoch:>5} {a:>15.6f} {b:>15.6f} {abs(a - b):>9.2e}")
    print_msg(
        "Max |prediction difference| after training: "
        f"{report['output_diff']:.2e}"
    )


if __name__ == "__main__":
    main()
