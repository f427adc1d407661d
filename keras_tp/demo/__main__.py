"""`python -m keras_tp.demo`: a transformer LM trained tensor-parallel.

Trains the same small transformer language model twice, on one device and
split over N devices (virtual CPU devices, real accelerators, or on torch
one process per rank), then prints the plan, the collectives of one
training step, the parameter bytes per device and both losses, with a
verdict on whether the two runs agree.
"""

import argparse
import collections
import os
import sys

from keras_tp.cli import BACKENDS
from keras_tp.cli import DEFAULT_BACKEND
from keras_tp.cli import choose_backend
from keras_tp.cli import describe_backend
from keras_tp.native_logs import quiet_native_logs

# The model the demo trains: `transformer_lm()`'s defaults, named here so
# that the demo can say what it trains.
MODEL = dict(vocab=64, seq_len=8, dim=16, heads=4, blocks=2)
# Largest difference between the split model and one device, in losses and
# in predictions after training, that counts as parity: float32 sums taken
# in another order drift by about 1e-5 over the demo's 80 Adam steps.
TOLERANCE = 1e-4


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m keras_tp.demo",
        description="Train a small transformer LM with tensor parallelism "
        "and compare it with the same model on one device.",
    )
    parser.add_argument(
        "--devices",
        type=int,
        help="tensor-parallel ranks (default 4; on torch one per GPU or "
        "CPU core, 2 to 4)",
    )
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        help=f"Keras backend (default: $KERAS_BACKEND, else {DEFAULT_BACKEND})",
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
    parser.add_argument(
        "--save",
        metavar="PATH.keras",
        help="save the trained model, unsplit, for `keras-tp plan`",
    )
    return parser.parse_args(argv)


def train_and_compare(devices, epochs, samples, save):
    """Trains the LM split over `devices` ranks, and on one device.

    Runs on every rank (`keras_tp.launch`). Rank 0 prints the plan and the
    progress bars, trains the one-device model and returns a dict with the
    plan, the collectives, the bytes and both runs' losses; other ranks
    return `None`.
    """
    import keras

    import keras_tp
    from keras_tp.demo.models import counting_sequences
    from keras_tp.demo.models import transformer_lm
    from keras_tp.keras_internals import print_msg

    # RANK is set in torch's rank processes (by `launch` or torchrun); JAX
    # and TensorFlow drive every device from this one process.
    chief = os.environ.get("RANK", "0") == "0"
    x, y = counting_sequences(samples, MODEL["vocab"], MODEL["seq_len"])
    parallel = keras_tp.TensorParallelKeras(
        transformer_lm(**MODEL), world_size=devices
    )
    # Only rank 0 compares: the other ranks need not train the one-device
    # model, and on torch they would take the cores it trains on.
    models = [parallel, transformer_lm(**MODEL)] if chief else [parallel]
    for model in models:
        model.compile(
            optimizer=keras.optimizers.Adam(3e-3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    fit_args = dict(
        x=x,
        y=y,
        batch_size=32,
        epochs=epochs,
        shuffle=False,
    )
    if not chief:
        parallel.fit(**fit_args)
        parallel.predict(x, verbose=0)
        if save:
            parallel.save(save)
        return None

    single = models[1]
    printed = []
    parallel.summary(print_fn=printed.append)
    # summary() prints the plan, then the parameter memory in MiB, which
    # the demo prints once, in bytes, with why it is not 1/N.
    print_msg(printed[0])
    print_msg("\nTraining on one device:")
    single_loss = single.fit(**fit_args).history["loss"]
    print_msg(f"\nTraining split over {devices} devices:")
    parallel_loss = parallel.fit(**fit_args).history["loss"]
    output_diff = float(
        abs(single.predict(x, verbose=0) - parallel.predict(x, verbose=0)).max()
    )
    if save:
        parallel.save(save)
    return {
        "info": parallel.get_parallelism_info(),
        "whole": whole_parameters(parallel),
        "collectives": parallel.communication_stats(),
        "single_loss": single_loss,
        "parallel_loss": parallel_loss,
        "output_diff": output_diff,
    }


def whole_parameters(parallel):
    """What every device of `parallel` holds whole, and its bytes.

    Returns:
        `{description: bytes}`, e.g. `{"5 LayerNormalization layers": 640,
        "the bias of 4 Row layers": 256}`: layers the plan leaves whole,
        and variables of split layers that are not split (a Row layer adds
        its bias once, after the all-reduce).
    """
    from keras_tp.plan.sharding_plan import walk_layers
    from keras_tp.tensors import nbytes

    plan = parallel.sharding_plan
    split = plan.variable_axes()
    styles = {entry.layer.path: entry.style for entry in plan.leaf_layers()}
    layers = {layer.path: layer for layer in walk_layers(parallel.model)}
    owners = collections.defaultdict(set)
    sizes = collections.Counter()
    for variable in parallel.model.weights:
        if variable.path in split:
            continue
        owner, name = variable.path.rsplit("/", 1)
        if owner in styles:
            kind = (type(styles[owner]).__name__, name)
        else:
            kind = (type(layers[owner]).__name__, None)
        owners[kind].add(owner)
        sizes[kind] += nbytes(variable)
    descriptions = {}
    for (layer_kind, name), size in sizes.items():
        count = len(owners[layer_kind, name])
        layers_text = f"{count} {layer_kind} layers"
        key = f"the {name} of {layers_text}" if name else layers_text
        descriptions[key] = size
    return descriptions


def default_devices(backend):
    """The demo's ranks: 4, or on torch one per GPU or CPU core (2 to 4).

    On torch every rank is a process, and processes that outnumber the
    cores take turns on them, each step waiting for the slowest. JAX's and
    TensorFlow's virtual devices live in one process and share the cores
    without that cost.
    """
    if backend != "torch":
        return 4
    import torch

    from keras_tp.launcher import usable_cores

    if torch.cuda.is_available():
        return min(4, torch.cuda.device_count())
    return max(2, min(4, usable_cores()))


def describe_devices(backend, count):
    """The devices `count` ranks run on, as words."""
    if backend == "torch":
        import torch

        where = "its own GPU" if torch.cuda.is_available() else "the CPU"
        return f"{count} processes, one rank each on {where}"
    import keras

    devices = keras.distribution.list_devices()[:count]
    return f"{count} devices: {', '.join(devices)}"


def main():
    """The demo program: `run(sys.argv[1:])` without native logs."""
    quiet_native_logs()
    return run(sys.argv[1:])


def run(argv):
    """Runs the demo with the command line arguments `argv`.

    Call it before Keras is imported: it sets `KERAS_BACKEND`.

    Returns:
        The exit status: 0 when the split model matches one device within
        `TOLERANCE`, else 1.
    """
    args = parse_args(argv)
    backend, reason = choose_backend(args.backend)
    os.environ["KERAS_BACKEND"] = backend
    import keras_tp

    devices = args.devices or default_devices(backend)
    keras_tp.configure_virtual_devices(devices)
    from keras_tp.keras_internals import print_msg

    where = describe_devices(backend, devices)
    if args.devices is None and backend == "torch":
        where += " (on torch: one per core or GPU, 2 to 4; --devices N)"
    print_msg(
        f"keras_tp demo: a transformer language model ({MODEL['blocks']} "
        f"blocks, width {MODEL['dim']}, {MODEL['heads']} heads) learns to "
        f"continue {args.samples} counting sequences of {MODEL['seq_len']} "
        f"tokens over {args.epochs} epochs, trained once on one device and "
        f"once split over {where}."
    )
    print_msg(f"Running on the {describe_backend(backend, reason)}.\n")
    report = keras_tp.launch(
        train_and_compare,
        world_size=devices,
        args=(devices, args.epochs, args.samples, args.save),
    )

    print_msg("\nCollectives in one training step (per rank):")
    for kind, stats in report["collectives"].items():
        print_msg(
            f"  {kind:12} forward {stats['forward_calls']:3} calls "
            f"{stats['forward_bytes']:>9,} B   "
            f"backward {stats['backward_calls']:3} "
            f"calls {stats['backward_bytes']:>9,} B"
        )
    print_msg("\n" + memory_summary(report["info"], report["whole"], devices))

    print_msg(
        f"\n{'epoch':>5} {'loss, 1 device':>15} "
        f"{f'loss, TP={devices}':>15} {'|diff|':>9}"
    )
    losses = list(zip(report["single_loss"], report["parallel_loss"]))
    for epoch, (a, b) in enumerate(losses, 1):
        print_msg(f"{epoch:>5} {a:>15.6f} {b:>15.6f} {abs(a - b):>9.2e}")
    loss_diff = max(abs(a - b) for a, b in losses)
    parity = max(loss_diff, report["output_diff"]) <= TOLERANCE
    print_msg(
        f"\nParity: {'PASS' if parity else 'FAIL'}. The split model "
        f"{'matches' if parity else 'does not match'} one device within "
        f"{TOLERANCE:.0e}: largest loss difference {loss_diff:.1e}, largest "
        f"prediction difference after training {report['output_diff']:.1e}."
    )
    if args.save:
        print_msg(
            f"Saved the trained model, unsplit, to {args.save}; see its "
            f"plan with: keras-tp plan {args.save} --world-size "
            f"{devices}"
        )
    return 0 if parity else 1


def memory_summary(info, whole, devices):
    """One sentence: parameter bytes per device, and why not 1/`devices`."""
    total = info["parameter_bytes_total"]
    per_device = max(info["parameter_bytes_per_device"].values())
    text = (
        f"Parameters: {total:,} B on one device, {per_device:,} B on each "
        f"of the {devices} devices ({per_device / total:.0%}"
    )
    if not whole:
        return text + ")."
    kept = " and ".join(whole)
    return (
        f"{text}, not {1 / devices:.0%}: {kept}, {sum(whole.values()):,} B, "
        "stay whole on every device)."
    )


if __name__ == "__main__":
    sys.exit(main())
