"""The arguments `TensorParallelKeras.compile()` passes on to Keras: as
the wrapped model resolves them, and the optimizer coordinated over the
data axis; what no rank can update from its pieces of the variables is
refused."""

import inspect

import keras

from keras_tp.keras_internals import compile_arguments
from keras_tp.keras_internals import exclude_from_weight_decay
from keras_tp.keras_internals import place_slots_on_creation
from keras_tp.keras_internals import weight_decay_excluded
from keras_tp.parallel import CoordinatedOptimizer
from keras_tp.parallel.entrywise import constraint_reads_across
from keras_tp.parallel.entrywise import reads_across_entries
from keras_tp.parallel.loss_scaling import scaled_loss_optimizer
from keras_tp.parallel.loss_scaling import unscaled

# `keras.Model.compile`'s parameters after `optimizer`.
_COMPILE_PARAMETERS = list(inspect.signature(keras.Model.compile).parameters)[
    2:
]


def by_name(args, kwargs):
    """`compile`'s arguments after the optimizer, all by name."""
    return {**dict(zip(_COMPILE_PARAMETERS, args)), **kwargs}


def resolved_by_model(model, args, kwargs):
    """`compile`'s arguments as `model`'s own `compile` resolves them; as
    given if it does not call Keras' `compile`.

    Returns:
        `(args, kwargs)` for `keras.Model.compile`.
    """
    model.compile(*args, **kwargs)
    if not model.compiled:
        return args, kwargs
    resolved = compile_arguments(model)
    if "jit_compile" not in kwargs:
        # The runtime's default, not the one Keras filled in.
        del resolved["jit_compile"]
    return (), resolved


def arguments_of(model):
    """The arguments `model` was compiled with, its optimizer anew if it
    was built (its state is that of the whole variables)."""
    arguments = compile_arguments(model)
    del arguments["jit_compile"]
    optimizer = arguments["optimizer"]
    if isinstance(optimizer, keras.optimizers.Optimizer) and optimizer.built:
        arguments["optimizer"] = type(optimizer).from_config(
            optimizer.get_config()
        )
        excluded = weight_decay_excluded(
            unscaled(optimizer), model.trainable_variables
        )
        exclude_from_weight_decay(unscaled(arguments["optimizer"]), excluded)
    return arguments


def optimizer_for(optimizer, runtime, trainer, arguments):
    """The optimizer `trainer` compiles with: `coordinated` over its
    `runtime`, with loss scaling that every rank decides alike where the
    loss is scaled (`keras_tp.parallel.loss_scaling`); `arguments` are
    the other arguments of `compile()`, by name."""
    return scaled_loss_optimizer(
        optimizer,
        trainer,
        runtime,
        lambda inner, loss_scaled: coordinated(
            inner, runtime, trainer, loss_scaled
        ),
        arguments.get("auto_scale_loss", True),
    )


def coordinated(optimizer, runtime, trainer, coordinating=False):
    """`optimizer` as `runtime` runs it: a `CoordinatedOptimizer` bound to
    it where its steps run per rank, or where ranks hold shards and the
    optimizer clips by norms or keeps state (`WHOLE_VARIABLE_OPTIONS`),
    else as given.

    Args:
        optimizer: the optimizer given to `compile()` (or its name).
        runtime: the runtime of the model being compiled.
        trainer: the `TensorParallelKeras` being compiled; its current
            optimizer may be compiled again, built.
        coordinating: whether to make it a `CoordinatedOptimizer` in any
            case: where a `GlobalLossScaleOptimizer` wraps it, which
            applies it inside a conditional (a `CoordinatedOptimizer`
            updates the pieces of the variables there on every backend),
            or where a pipeline stage's copy accumulates, averages the
            weights or takes norms over the stage's devices.

    Returns:
        The optimizer to compile with.
    """
    check_unbuilt(optimizer, own=getattr(trainer, "optimizer", None))
    _check_entrywise(optimizer, runtime)
    _check_constraints(trainer.trainable_variables, runtime)
    bound_to = runtime.optimizer_runtime
    if isinstance(optimizer, CoordinatedOptimizer):
        if runtime.pipeline_parallel > 1:
            raise ValueError(
                "A pipelined model takes a plain Keras optimizer, not a "
                "CoordinatedOptimizer: each stage updates its own "
                "variables, and its replicas combine their gradients "
                "themselves. Pass the inner optimizer, and zero_stage to "
                "TensorParallelKeras."
            )
        if optimizer.zero_stage != runtime.zero_stage:
            raise ValueError(
                f"The CoordinatedOptimizer has zero_stage="
                f"{optimizer.zero_stage} but the model was built with "
                f"zero_stage={runtime.zero_stage}; make them agree."
            )
        # Without a data axis it still clips and accumulates.
        bound_to = bound_to or runtime.coordinating_runtime
    elif (
        bound_to is not None
        or coordinating
        or _needs_whole_variables(optimizer, runtime)
    ):
        bound_to = bound_to or runtime.coordinating_runtime
        inner = keras.optimizers.get(optimizer)
        # The wrapper accumulates instead, synchronising only at the
        # accumulation boundaries.
        steps = inner.gradient_accumulation_steps or 1
        inner.gradient_accumulation_steps = None
        optimizer = CoordinatedOptimizer(
            inner,
            zero_stage=runtime.zero_stage,
            gradient_accumulation_steps=steps,
        )
    else:
        return optimizer
    bound_to.bind_optimizer(optimizer)
    return optimizer


# Options of a Keras optimizer that read whole variables or carry state
# across steps: norms, weight averages, accumulated gradients.
WHOLE_VARIABLE_OPTIONS = (
    "clipnorm",
    "global_clipnorm",
    "use_ema",
    "gradient_accumulation_steps",
)


def _needs_whole_variables(optimizer, runtime):
    """Whether `optimizer` uses `WHOLE_VARIABLE_OPTIONS` where each rank
    updates its pieces of the variables: a plain optimizer would clip each
    rank's shards by their own norms, so a `CoordinatedOptimizer` takes
    the norms over the whole model (bound to the runtime's
    `coordinating_runtime`; where it has none, its stages compile their
    optimizers themselves); and in a pipeline, `global_clipnorm`, whose
    norm spans every stage's gradients."""
    if runtime.coordinating_runtime is None or not isinstance(
        optimizer, keras.optimizers.Optimizer
    ):
        return False
    if runtime.pipeline_parallel > 1 and optimizer.global_clipnorm:
        # Its norm spans every stage's gradients.
        return True
    return runtime.updates_pieces and any(
        getattr(optimizer, name) for name in WHOLE_VARIABLE_OPTIONS
    )


def _check_entrywise(optimizer, runtime):
    """Refuses an optimizer whose update of an entry reads other entries
    of its variable (`reads_across_entries`) where each rank updates its
    pieces of the variables."""
    if not runtime.updates_pieces:
        return
    optimizer = keras.optimizers.get(optimizer)
    optimizers = [optimizer]
    if isinstance(optimizer, CoordinatedOptimizer):
        optimizers = optimizer.wrapped_optimizers
    for each in optimizers:
        if reads_across_entries(each):
            raise ValueError(
                f"Optimizer '{each.name}' ({type(each).__name__}) updates "
                "an entry of a variable from other entries of it (norms "
                "or means over the variable, as Lamb, Adafactor and Muon "
                "do), but here each rank updates its own pieces of the "
                f"variables ({_pieces(runtime)}), so each piece would "
                "take another update than on one device. Use an "
                "optimizer that updates entry by entry (Adam, AdamW, "
                "SGD, Lion, ...), or a layout whose ranks update whole "
                "variables (tensor parallelism alone on JAX)."
            )


def _check_constraints(variables, runtime):
    """Refuses a variable's constraint that reads entries across an axis
    its variable is cut along (`constraint_reads_across`) where each rank
    updates its pieces of the variables."""
    if not runtime.updates_pieces:
        return
    placement = runtime.placement
    for variable in variables:
        if variable.constraint is None:
            continue
        cut = {placement.split_axis(variable)}
        if runtime.partitions_variables:
            cut.add(placement.partition_axis(variable))
        for axis in cut - {None}:
            ndim = len(variable.shape)
            if constraint_reads_across(variable.constraint, ndim, axis):
                raise ValueError(
                    f"Variable '{variable.path}' has a constraint "
                    f"({type(variable.constraint).__name__}) that reads its "
                    f"entries across axis {axis}, along which each rank "
                    f"holds and updates a piece of it ({_pieces(runtime)}): "
                    "each piece would be constrained alone. Constrain "
                    "another axis (a norm per output unit of a Column "
                    "split), remove the constraint, or keep the layer whole "
                    "(plan it Replicate)."
                )


def _pieces(runtime):
    pieces = []
    if runtime.tensor_parallel > 1:
        pieces.append(f"tensor_parallel={runtime.tensor_parallel} shards")
    if runtime.partitions_variables:
        pieces.append(f"zero_stage={runtime.zero_stage} partitions")
    return " and ".join(pieces)


def check_unbuilt(optimizer, own=None):
    """Refuses an optimizer already built, unless it is `own`.

    A built optimizer holds the state (moments, step count) of the
    variables it was built on: compiled with another model, it would
    silently apply that state to this model's variables.

    Args:
        optimizer: the optimizer to compile with, or its name.
        own: the model's current optimizer, which may be compiled again.

    Raises:
        ValueError: if `optimizer` is built and is not `own`.
    """
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        return
    if optimizer.built and optimizer is not own:
        raise ValueError(
            f"Optimizer '{optimizer.name}' is already built on other "
            "variables, and would carry their state (moments, step count) "
            "over. Give TensorParallelKeras.compile() a new optimizer, such "
            f"as `keras.optimizers.{type(optimizer).__name__}.from_config("
            "optimizer.get_config())`."
        )


def place_slots(optimizer, runtime):
    """Splits the slots of a compiled plain optimizer like their variables
    (a `CoordinatedOptimizer` places them with their ZeRO partitions); a
    `LossScaleOptimizer`'s are its inner optimizer's."""
    optimizer = unscaled(optimizer)
    if not isinstance(optimizer, CoordinatedOptimizer):
        place_slots_on_creation(optimizer, runtime.placement.place_like)
