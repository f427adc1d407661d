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
import atexit
import importlib
import math
import os
import re
import subprocess
import sys
import threading

from keras_tp import __version__

BACKENDS = ("jax", "torch", "tensorflow")
DEFAULT_BACKEND = "jax"
ZERO_STAGES = (0, 1, 2, 3)
ADAM_SLOTS = 2

# A line of the C++ logs of TensorFlow, XLA or absl, e.g. "I0000
# 00:00:1795424013.569436   26970 port.cc:153] oneDNN custom operations
# are on. ..."; the first letter is the severity.
_NATIVE_LOG_LINE = re.compile(rb"([IWEF])\d{4} [\d:.]+ +\d+ \S+:\d+\] ")
_NATIVE_SEVERITIES = b"IWEF"
# Lines that come with those INFO lines: absl's notice that it logs before
# it is initialised, and the second line of TensorFlow's CPU feature notice.
_NATIVE_INFO_COMPANIONS = (
    b"WARNING: All log messages before absl::InitializeLog() is called",
    b"To enable the following instructions:",
)
# The C++ libraries write to this file descriptor, whatever sys.stderr is.
_STDERR_FD = 2
# Seconds to wait at exit for the last lines of stderr to be copied.
_STDERR_DRAIN_SECONDS = 2.0


class CommandError(Exception):
    """A user error, reported as one line on stderr with exit status 1."""


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


def quiet_native_logs():
    """Keeps the C++ log lines of TensorFlow, XLA and absl off stderr.

    Only the `keras-tp` and demo programs call this, never an import:
    a library must not change its user's environment. TensorFlow writes
    several lines when it loads (oneDNN, CUDA stubs, CPU features), some
    before it reads `TF_CPP_MIN_LOG_LEVEL`, and it loads on every backend
    where it is installed, through `keras.utils.set_random_seed`. So this
    sets `TF_CPP_MIN_LOG_LEVEL` to 3 unless it is set, and routes the
    stderr of this process, which child processes inherit, through a
    thread that drops the log lines below that level. Fatal lines,
    Python's warnings and tracebacks pass unchanged;
    `TF_CPP_MIN_LOG_LEVEL=0` shows every line.
    """
    level = os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    # TensorFlow's levels: 1 hides INFO, 2 also WARNING, 3 also ERROR.
    if level not in ("1", "2", "3"):
        return
    hidden = _NATIVE_SEVERITIES[: int(level)]
    try:
        terminal = os.dup(_STDERR_FD)
    except OSError:
        return  # No stderr to filter.
    read_end, write_end = os.pipe()
    os.dup2(write_end, _STDERR_FD)
    os.close(write_end)
    copier = threading.Thread(
        target=_copy_without_native_logs,
        args=(read_end, terminal, hidden),
        name="keras-tp-stderr",
        daemon=True,
    )
    copier.start()
    atexit.register(_restore_stderr, terminal, copier)


def _copy_without_native_logs(read_end, terminal, hidden):
    with open(read_end, "rb") as pipe:
        for line in pipe:
            log = _NATIVE_LOG_LINE.match(line)
            if log:
                if log.group(1) in hidden:
                    continue
            elif line.startswith(_NATIVE_INFO_COMPANIONS) and b"I" in hidden:
                continue
            try:
                os.write(terminal, line)
            except OSError:
                # Whoever read stderr went away (`... 2>&1 | head`): keep
                # draining the pipe, so that no writer blocks on it.
                pass


def _restore_stderr(terminal, copier):
    sys.stderr.flush()
    # Closes this process's end of the pipe: the copier reads to its end
    # once the child processes that inherited the pipe have exited too.
    os.dup2(terminal, _STDERR_FD)
    copier.join(_STDERR_DRAIN_SECONDS)


def build_parser():
    """The `argparse` parser of `keras-tp` and its subcommands."""
    parser = argparse.ArgumentParser(
        prog="keras-tp",
        description="Tensor parallelism for Keras 3: inspect the plan of a "
        "saved model, or run the demo. Both run on the backend --backend "
        f"names, else $KERAS_BACKEND, else {DEFAULT_BACKEND}.",
        epilog=_examples(
            "keras-tp demo --save lm.keras",
            "keras-tp plan lm.keras --world-size 8 --data-parallel 2 "
            "--zero-stage 1",
        ),
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
        epilog=_examples(
            "keras-tp demo --save lm.keras",
            "keras-tp plan lm.keras --world-size 8 --data-parallel 2 "
            "--zero-stage 1",
        ),
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
        choices=ZERO_STAGES,
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
    from keras_tp.plan.sharding_plan import ShardingError
    from keras_tp.plan.sharding_plan import check_shardable

    if plan.tensor_parallel == 1:
        return
    split = {entry.layer.path for entry in plan.layers}
    whole = []
    for entry in auto_plan(model, 1).layers:
        if entry.layer.path in split:
            continue
        if isinstance(entry, ShardedUnit):
            leaves = entry.projections.values()
        else:
            leaves = [entry]
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
            shape[axis] //= self.plan.tensor_parallel
        return tuple(shape)

    def local_bytes(self, variables, split=True):
        """Bytes of `variables` on one model rank (`split=False`: unsplit)."""
        from keras_tp.collectives.base import nbytes

        return sum(
            nbytes(v, self.local_shape(v) if split else None) for v in variables
        )

    def layer_table(self):
        """Per split layer: variable, style, local shape, bytes/device."""
        from keras_tp.plan.report import split_variable_table
        from keras_tp.plan.sharding_plan import walk_layers

        lines = split_variable_table(self.plan, self.local_shape)
        listed = {
            id(variable)
            for entry in self.plan.leaf_layers()
            for variable in entry.handler.variables(entry.layer).values()
        }
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
