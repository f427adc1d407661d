"""`keras-tp`: print a saved model's tensor-parallel plan, or run the demo.

```
keras-tp plan MODEL.keras --world-size 4 [--data-parallel 2 --zero-stage 1]
keras-tp demo [--backend jax|torch|tensorflow] [--devices N] [--save PATH]
```

`plan` needs no devices: it loads the model, applies `keras_tp.auto_plan`
for the tensor-parallel size, and derives local shapes and bytes from the
plan. The memory it prints for data parallelism and ZeRO comes from the
ZeRO paper's formulas, not from measurement.

Both commands run on the backend that `--backend` names, else
`$KERAS_BACKEND`, else JAX. Keras, and with it the backend, is imported
only by the command that needs it, so that `--help` answers at once.
"""

import argparse
import importlib
import os
import subprocess
import sys

from keras_tp import __version__
from keras_tp.errors import CommandError
from keras_tp.errors import ShardingError
from keras_tp.native_logs import quiet_native_logs

BACKENDS = ("jax", "torch", "tensorflow")
DEFAULT_BACKEND = "jax"


def main():
    """The `keras-tp` program: `run(sys.argv[1:])`, without native logs.

    Returns:
        `run`'s exit status.
    """
    quiet_native_logs()
    return run(sys.argv[1:])


def run(argv):
    """Runs `keras-tp` with the command line arguments `argv`.

    Args:
        argv: the command line arguments, without the program name.

    Returns:
        The exit status: 0 on success, 1 on a user error (a bad path, a
        world size that does not divide the model), 2 on a usage error.

    Example:

    ```python
    from keras_tp import cli
    cli.run(["plan", "lm.keras", "--world-size", "4"])
    ```
    """
    argv = list(argv)
    args = build_parser().parse_args(argv)
    try:
        return args.run(args, argv)
    except CommandError as error:
        print(f"keras-tp {args.command}: error: {error}", file=sys.stderr)
        return 1
    except BrokenPipeError:
        # The reader went away (`keras-tp plan ... | head`): stop quietly,
        # and keep Python's flush at exit from failing on the closed pipe.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def choose_backend(requested=None):
    """The Keras backend a command runs on, and what chose it.

    `requested` (the `--backend` option), else `$KERAS_BACKEND`, else JAX:
    the rule of `keras-tp plan`, `keras-tp demo` and
    `python -m keras_tp.demo` alike. Keras' own `keras.json` does not decide:
    Keras writes one naming TensorFlow the first time it is imported, so
    that file does not tell what the user chose.

    Args:
        requested: the backend named on the command line, or `None`.

    Returns:
        `(backend, reason)`, the reason being a few words such as
        `"the default"` or `"from KERAS_BACKEND"`.
    """
    if requested:
        return requested, "from --backend"
    if os.environ.get("KERAS_BACKEND"):
        return os.environ["KERAS_BACKEND"], "from KERAS_BACKEND"
    return DEFAULT_BACKEND, "the default"


def describe_backend(backend, reason):
    """One phrase naming the backend, why, and how to choose another."""
    return (
        f"backend {backend} ({reason}; choose one with --backend or "
        "KERAS_BACKEND)"
    )


def build_parser():
    """The `argparse` parser of `keras-tp` and its subcommands."""
    examples = _examples(
        "keras-tp demo --save lm.keras",
        "keras-tp plan lm.keras --world-size 8 --data-parallel 2 "
        "--zero-stage 1",
    )
    parser = argparse.ArgumentParser(
        prog="keras-tp",
        description="Tensor parallelism for Keras 3: inspect the plan of a "
        "saved model, or run the demo. Both run on the backend --backend "
        f"names, else $KERAS_BACKEND, else {DEFAULT_BACKEND}.",
        epilog=examples,
        formatter_class=_HelpFormatter,
    )
    parser.add_argument(
        "--version", action="version", version=f"keras_tp {__version__}"
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND"
    )
    backend_help = (
        f"Keras backend (default: $KERAS_BACKEND, else {DEFAULT_BACKEND})"
    )

    plan = commands.add_parser(
        "plan",
        help="print the tensor-parallel plan and memory per device of a "
        "saved .keras model (needs no devices)",
        description="Load a saved .keras model, apply the automatic "
        "tensor-parallel plan for WORLD_SIZE / DATA_PARALLEL ranks, and "
        "print per layer the style, the local shape and the bytes per "
        "device, then the bytes per device of parameters, gradients and "
        "Adam state (2 slots) for ZeRO stages 0 to 3. Runs on one CPU: "
        "nothing is placed on devices.",
        epilog=examples,
        formatter_class=_HelpFormatter,
    )
    plan.add_argument("model", metavar="MODEL.keras", help="a saved model")
    plan.add_argument(
        "--world-size",
        type=_positive_int,
        required=True,
        help="total devices: data parallel x tensor parallel",
    )
    plan.add_argument(
        "--data-parallel",
        type=_positive_int,
        default=1,
        help="data-parallel replicas; must divide --world-size (default 1)",
    )
    plan.add_argument(
        "--zero-stage",
        type=int,
        choices=range(4),
        default=0,
        help="ZeRO stage to highlight in the memory table (default 0)",
    )
    plan.add_argument(
        "--backend",
        choices=BACKENDS,
        help=f"{backend_help}; the plan is the same on every backend",
    )
    plan.add_argument(
        "--import",
        dest="modules",
        action="append",
        default=[],
        metavar="MODULE",
        help="Python module to import first, so that the model's custom "
        "layers are registered (repeatable)",
    )
    plan.add_argument(
        "--allow-replicated",
        action="store_true",
        help="print the plan even when layers stay whole on every device "
        "because their dimensions do not divide the tensor-parallel size",
    )
    plan.set_defaults(run=run_plan)

    demo = commands.add_parser(
        "demo",
        help="train a small transformer LM tensor-parallel next to the same "
        "model on one device",
        description="Run `python -m keras_tp.demo`: train a small "
        "transformer language model split over N devices (virtual CPU "
        "devices on a CPU machine; one process per rank on torch) and the "
        "same model on one device, and print the plan, the collectives of "
        "one training step, the parameter bytes per device and both losses "
        "with a parity verdict.",
        epilog=_examples("keras-tp demo --save lm.keras"),
        formatter_class=_HelpFormatter,
    )
    demo.add_argument("--backend", choices=BACKENDS, help=backend_help)
    demo.add_argument(
        "--devices", type=_positive_int, help="tensor-parallel ranks (4)"
    )
    demo.add_argument("--epochs", type=_positive_int, help="epochs (5)")
    demo.add_argument(
        "--samples", type=_positive_int, help="training sequences (512)"
    )
    demo.add_argument(
        "--save",
        metavar="PATH.keras",
        help="save the trained model, unsplit, for `keras-tp plan`",
    )
    demo.set_defaults(run=run_demo)
    return parser


def _examples(*commands):
    return "examples:\n" + "\n".join(f"  {command}" for command in commands)


class _HelpFormatter(argparse.HelpFormatter):
    """Wraps descriptions, and keeps the examples one command a line."""

    def _fill_text(self, text, width, indent):
        if text.startswith("examples:"):
            return "".join(indent + line for line in text.splitlines(True))
        return super()._fill_text(text, width, indent)


def _positive_int(text):
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(
            f"must be a positive integer, got {text!r}"
        )
    return value


def run_demo(args, argv):
    """`keras-tp demo`: runs `python -m keras_tp.demo` with the options."""
    command = [sys.executable, "-m", "keras_tp.demo"]
    for option in ("backend", "devices", "epochs", "samples", "save"):
        value = getattr(args, option)
        if value is not None:
            command += [f"--{option}", str(value)]
    return subprocess.call(command)


def run_plan(args, argv):
    """`keras-tp plan`: prints the plan and the memory per device."""
    if args.world_size % args.data_parallel:
        raise CommandError(
            f"--world-size {args.world_size} is not divisible by "
            f"--data-parallel {args.data_parallel}: the devices form a "
            "data x model grid."
        )
    tensor_parallel = args.world_size // args.data_parallel
    if not os.path.isfile(args.model):
        raise CommandError(f"no such file: {args.model}")
    backend, reason = choose_backend(args.backend)
    loaded = sys.modules.get("keras")
    if loaded is not None and loaded.backend.backend() != backend:
        # Keras reads KERAS_BACKEND once, at import: another backend needs
        # a fresh interpreter.
        env = {**os.environ, "KERAS_BACKEND": backend}
        command = [sys.executable, "-m", "keras_tp.cli", *argv]
        return subprocess.call(command, env=env)
    _import_keras(backend)
    # Registers the demo's custom layers, so that saved demo models load.
    import keras_tp.demo.models  # noqa: F401
    from keras_tp.plan.auto import auto_plan
    from keras_tp.plan.memory import PlanReport

    for module in args.modules:
        try:
            importlib.import_module(module)
        except ImportError as error:
            raise CommandError(f"--import {module}: {error}")
    model = _load_model(args.model)
    try:
        plan = auto_plan(model, tensor_parallel)
    except ValueError as error:
        raise CommandError(_first_line(error))
    if not args.allow_replicated:
        _check_divisible(model, plan, args.world_size)
    report = PlanReport(model, plan, args.data_parallel)
    print(
        f"Model '{model.name}' ({args.model}), world size "
        f"{args.world_size} = data parallel {args.data_parallel} x "
        f"tensor parallel {tensor_parallel}, "
        f"{describe_backend(backend, reason)}"
    )
    print()
    print(report.layer_table())
    print()
    print(report.memory_table(args.zero_stage))
    return 0


def _import_keras(backend):
    """Imports Keras on `backend` (Keras reads KERAS_BACKEND at import)."""
    os.environ["KERAS_BACKEND"] = backend
    try:
        import keras  # noqa: F401
    except ImportError as error:
        raise CommandError(
            f"Keras cannot load the {backend} backend "
            f"({_first_line(error)}): install it "
            f'(pip install "keras_tp[{backend}]") or choose another one '
            "with --backend or KERAS_BACKEND."
        )


def _load_model(path):
    import keras

    try:
        return keras.saving.load_model(path, compile=False)
    except Exception as error:
        # Keras raises many types here (ValueError, TypeError, zipfile and
        # h5py errors); all mean the same to a user: this file won't load.
        raise CommandError(
            f"cannot load {path}: {_first_line(error)} (if the model has "
            "custom layers, name the module that registers them with "
            "--import MODULE)"
        )


def _first_line(error):
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def _check_divisible(model, plan, world_size):
    """Refuses a plan that leaves layers whole because sizes don't divide.

    Such a layer is one that `auto_plan` splits for one rank, with a style
    that cannot split it at this plan's size. Layers whole for other
    reasons (a LayerNorm outside a Column -> Row pair) do not count.
    """
    from keras_tp.plan.auto import auto_plan
    from keras_tp.plan.sharding_plan import ShardedUnit
    from keras_tp.plan.sharding_plan import check_shardable

    if plan.tensor_parallel == 1:
        return
    split = {entry.layer.path for entry in plan.layers}
    whole = []
    for entry in auto_plan(model, 1).layers:
        if entry.layer.path in split:
            continue
        unit = isinstance(entry, ShardedUnit)
        leaves = entry.projections.values() if unit else [entry]
        try:
            for leaf in leaves:
                check_shardable(
                    leaf.layer, leaf.handler, leaf.style, plan.tensor_parallel
                )
        except ShardingError:
            whole.append(entry.layer.path)
    if whole:
        names = ", ".join(whole[:3]) + (", ..." if len(whole) > 3 else "")
        raise CommandError(
            f"--world-size {world_size} gives tensor-parallel size "
            f"{plan.tensor_parallel}, which does not divide the dimensions of "
            f"{len(whole)} layer(s) of '{model.name}' ({names}): they would "
            "stay whole on every device. Pick a world size whose "
            "tensor-parallel part divides them, or pass --allow-replicated "
            "to see the plan and the reasons."
        )


if __name__ == "__main__":
    sys.exit(main())
