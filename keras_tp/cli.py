"""`keras-tp`: print a saved model's tensor-parallel plan, or run the demo.

```
keras-tp plan MODEL.keras --world-size 4 [--data-parallel 2 --zero-stage 1]
keras-tp demo [--backend jax|torch|tensorflow] [--devices N]
```

`plan` needs no devices: it loads the model, applies `keras_tp.auto_plan`
for the tensor-parallel size, and derives local shapes and bytes from the
plan. The memory it prints for data parallelism and ZeRO comes from the
ZeRO paper's formulas, not from measurement.
"""

import argparse
import importlib
import math
import os
import subprocess
import sys

import keras

from keras_tp import __version__
from keras_tp.collectives.base import nbytes
from keras_tp.plan.auto import auto_plan
from keras_tp.plan.sharding_plan import walk_layers

BACKENDS = ("jax", "torch", "tensorflow")
ZERO_STAGES = (0, 1, 2, 3)
ADAM_SLOTS = 2


class CommandError(Exception):
    """A user error, reported as one line on stderr with exit status 1."""


def main(argv=None):
    """Runs `keras-tp` with `argv` (default: `sys.argv[1:]`).

    Args:
        argv: the command line arguments, without the program name.

    Returns:
        The exit status: 0 on success, 1 on a user error (a bad path, a
        world size that does not divide the model), 2 on a usage error.

    Example:

    ```python
    from keras_tp import cli
    cli.main(["plan", "model.keras", "--world-size", "4"])
    ```
    """
    argv = sys.argv[1:] if argv is None else list(argv)
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


def build_parser():
    """The `argparse` parser of `keras-tp` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="keras-tp",
        description="Tensor parallelism for Keras 3: inspect the plan of a "
        "saved model, or run the demo.",
    )
    parser.add_argument(
        "--version", action="version", version=f"keras_tp {__version__}"
    )
    commands = parser.add_subparsers(
        dest="command", required=True, metavar="COMMAND"
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
        epilog="example: keras-tp plan model.keras --world-size 8 "
        "--data-parallel 2 --zero-stage 1",
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
        choices=ZERO_STAGES,
        default=0,
        help="ZeRO stage to highlight in the memory table (default 0)",
    )
    plan.add_argument(
        "--backend",
        choices=BACKENDS,
        help="Keras backend that loads the model (default: the one Keras "
        "is configured with); the plan is the same on every backend",
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
        "devices on a CPU machine) and the same model on one device, and "
        "print the plan, the bytes per device, the collectives of one "
        "training step and both losses.",
    )
    demo.add_argument(
        "--backend",
        choices=BACKENDS,
        help="Keras backend (default: $KERAS_BACKEND, else jax)",
    )
    demo.add_argument(
        "--devices", type=_positive_int, help="tensor-parallel ranks (4)"
    )
    demo.add_argument("--epochs", type=_positive_int, help="epochs (5)")
    demo.add_argument(
        "--samples", type=_positive_int, help="training sequences (512)"
    )
    demo.set_defaults(run=run_demo)
    return parser


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
    for option in ("backend", "devices", "epochs", "samples"):
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
    if args.backend and args.backend != keras.backend.backend():
        # Keras reads KERAS_BACKEND once, at import: another backend needs
        # a fresh interpreter.
        env = {**os.environ, "KERAS_BACKEND": args.backend}
        command = [sys.executable, "-m", "keras_tp.cli", *argv]
        return subprocess.call(command, env=env)
    # Registers the demo's custom layers, so that saved demo models load.
    import keras_tp.demo.models  # noqa: F401

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
        f"tensor parallel {tensor_parallel}, backend "
        f"{keras.backend.backend()}"
    )
    print()
    print(report.layer_table())
    print()
    print(report.memory_table(args.zero_stage))
    return 0


def _load_model(path):
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

    A layer that `auto_plan` splits for one rank but not for this plan's
    size stays whole only because one of its dimensions does not divide.
    """
    if plan.world_size == 1:
        return
    split = {entry.layer.path for entry in plan.layers}
    splittable = auto_plan(model, 1).layers
    whole = [e.layer.path for e in splittable if e.layer.path not in split]
    if whole:
        names = ", ".join(whole[:3]) + (", ..." if len(whole) > 3 else "")
        raise CommandError(
            f"--world-size {world_size} gives tensor-parallel size "
            f"{plan.world_size}, which does not divide the dimensions of "
            f"{len(whole)} layer(s) of '{model.name}' ({names}): they would "
            "stay whole on every device. Pick a world size whose "
            "tensor-parallel part divides them, or pass --allow-replicated "
            "to see the plan and the reasons."
        )


def zero_memory(trainable, frozen, data_parallel, zero_stage):
    """Bytes per device of parameters, gradients and Adam state under ZeRO.

    The ZeRO paper's formulas with `P = trainable` and `D = data_parallel`:
    stage 0 keeps `P + P + 2P` (parameters, gradients, Adam's two slots),
    stage 1 partitions the Adam state (`P + P + 2P/D`), stage 2 also the
    gradients (`P + P/D + 2P/D`), stage 3 also the parameters
    (`(P + P + 2P)/D`). Frozen variables have no gradient or Adam state and
    are never partitioned.

    Args:
        trainable: bytes of trainable parameters one model rank holds.
        frozen: bytes of non-trainable variables one model rank holds.
        data_parallel: number of data-parallel replicas, `D`.
        zero_stage: 0 (no ZeRO) to 3.

    Returns:
        `{"parameters", "gradients", "adam", "total"}` in bytes.

    Example:

    >>> zero_memory(1000, 0, data_parallel=4, zero_stage=1)["total"]
    2500
    """

    def partitioned(nbytes, from_stage):
        if zero_stage >= from_stage:
            return math.ceil(nbytes / data_parallel)
        return nbytes

    memory = {
        "parameters": partitioned(trainable, 3) + frozen,
        "gradients": partitioned(trainable, 2),
        "adam": partitioned(ADAM_SLOTS * trainable, 1),
    }
    memory["total"] = sum(memory.values())
    return memory


class PlanReport:
    """Local shapes and bytes per device of a model under a bound plan.

    Everything is derived from the plan and the variables' full shapes, so
    no device is needed.

    Args:
        model: the Keras model the plan is bound to.
        plan: a bound `keras_tp.ShardingPlan`.
        data_parallel: number of data-parallel replicas (ZeRO's `D`).
    """

    def __init__(self, model, plan, data_parallel):
        self.model = model
        self.plan = plan
        self.data_parallel = data_parallel
        self.split_axes = {
            id(variable): axis
            for variable, axis in plan.variable_axes().values()
        }

    def local_shape(self, variable):
        """The shape of one tensor-parallel rank's shard of `variable`."""
        shape = list(variable.shape)
        axis = self.split_axes.get(id(variable))
        if axis is not None:
            shape[axis] //= self.plan.world_size
        return tuple(shape)

    def local_bytes(self, variables, split=True):
        """Bytes of `variables` on one model rank (`split=False`: unsplit)."""
        return sum(
            nbytes(v, self.local_shape(v) if split else None) for v in variables
        )

    def layer_table(self):
        """Per split layer: variable, style, local shape, bytes/device."""
        header = (
            f"{'Layer (variable)':48} {'Style':28} {'Source':24} "
            f"{'Local shape':18} {'Bytes/device':>12}"
        )
        lines = [
            f"Tensor-parallel plan, tensor_parallel={self.plan.world_size}",
            header,
            "-" * len(header),
        ]
        listed = set()
        for entry in self.plan.leaf_layers():
            primary = entry.handler.primary
            for role, variable in entry.handler.variables(entry.layer).items():
                listed.add(id(variable))
                style = repr(entry.style) if role == primary else ""
                source = self.plan.source_of(entry) if role == primary else ""
                lines.append(
                    f"{variable.path:48} {style:28} {source:24} "
                    f"{str(self.local_shape(variable)):18} "
                    f"{self.local_bytes([variable]):>12,}"
                )
        if self.plan.replicated:
            lines.append("Replicated (whole on every device):")
            layers = {layer.path: layer for layer in walk_layers(self.model)}
            paths = self.plan.replicated
            for path, reason in paths.items():
                # A whole attention layer is listed with its projections'
                # bytes and its own reason, not projection by projection.
                if any(path.startswith(parent + "/") for parent in paths):
                    continue
                variables = [
                    v for v in layers[path].weights if id(v) not in listed
                ]
                size = self.local_bytes(variables)
                lines.append(f"  {path} ({size:,} B): {reason}")
        return "\n".join(lines)

    def memory(self, zero_stage):
        """`zero_memory()` of one device of this plan at `zero_stage`."""
        return zero_memory(
            self.local_bytes(self.model.trainable_variables),
            self.local_bytes(self.model.non_trainable_variables),
            self.data_parallel,
            zero_stage,
        )

    def memory_table(self, zero_stage):
        """The memory per device of ZeRO stages 0 to 3, as text."""
        one_device = zero_memory(
            self.local_bytes(self.model.trainable_variables, split=False),
            self.local_bytes(self.model.non_trainable_variables, split=False),
            data_parallel=1,
            zero_stage=0,
        )
        trainable = self.local_bytes(self.model.trainable_variables)
        header = (
            f"{'ZeRO stage':12} {'Parameters':>14} {'Gradients':>14} "
            f"{'Adam state':>14} {'Total':>14}"
        )
        lines = [
            "Bytes per device with Adam (2 slots), from the ZeRO formulas:",
            f"  P = {trainable:,} B of trainable parameters per "
            f"tensor-parallel rank, D = {self.data_parallel} data-parallel "
            "replicas",
            "  stage 0: P + P + 2P   stage 1: P + P + 2P/D   "
            "stage 2: P + P/D + 2P/D   stage 3: (P + P + 2P)/D",
            header,
            "-" * len(header),
        ]
        for stage in (*ZERO_STAGES, None):
            if stage is None:
                memory, label = one_device, "one device"
            else:
                memory = self.memory(stage)
                label = f"{stage} (off)" if stage == 0 else str(stage)
            marker = "  <- --zero-stage" if stage == zero_stage else ""
            lines.append(
                f"{label:12} {memory['parameters']:>14,} "
                f"{memory['gradients']:>14,} {memory['adam']:>14,} "
                f"{memory['total']:>14,}{marker}"
            )
        return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
