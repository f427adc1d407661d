"""How `TensorParallelKeras` splits a model it wraps: the plan bound to
the model, its variables placed, its split layers' regions installed."""

import logging
import weakref

import keras

from keras_tp import generation
from keras_tp import partial_gradients
from keras_tp import regions
from keras_tp import split_regularizers
from keras_tp.collectives.sequence import warn_without_sequence_axis
from keras_tp.errors import ShardingError
from keras_tp.errors import check_count
from keras_tp.keras_internals import clear_added_losses
from keras_tp.keras_internals import own_variables
from keras_tp.keras_internals import sublayers
from keras_tp.parallel import batch_statistics
from keras_tp.parallel import zero3
from keras_tp.plan.auto import plan_from_trace
from keras_tp.plan.local_check import check_locally
from keras_tp.plan.sharding_plan import ShardingPlan
from keras_tp.plan.trace import trace_model
from keras_tp.runtime.mesh import MeshRuntime

logger = logging.getLogger(__name__)

# Models whose layers were converted in place, so they are not split twice.
_WRAPPED_MODELS = weakref.WeakSet()


def check_wrappable(model, config):
    """Raises if `model` is not a built `keras.Model` not yet split; warns
    where `config`'s sequence parallelism would split nothing of it."""
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"TensorParallelKeras wraps a keras.Model, got {type(model)}."
        )
    if model in _WRAPPED_MODELS:
        raise ValueError(
            f"Model '{model.name}' is already split by a "
            "TensorParallelKeras. Wrap each model once; to change the "
            "plan, rebuild the model (or load its saved copy)."
        )
    if not model.built:
        raise ValueError(
            f"Model '{model.name}' is not built. Call "
            "`model.build(input_shape)` or run it once on a batch first."
        )
    if config.sequence_parallel:
        warn_without_sequence_axis(model)


def bind_plan(model, plan, runtime, sample_batch=None):
    """`plan` (`"auto"`, a `ShardingPlan`, a dict, a list of rules or a
    `keras.distribution.LayoutMap`) bound to `model` at the runtime's
    tensor-parallel size, traced on `sample_batch` (or a probe batch)."""
    tensor_parallel = runtime.tensor_parallel
    held = runtime.weights_held_by_graph(model)
    if isinstance(plan, (keras.distribution.LayoutMap, str)):
        if plan != "auto" and isinstance(plan, str):
            raise ValueError(
                f"plan must be 'auto', a ShardingPlan or a dict, got {plan!r}."
            )
        layout_map = None if isinstance(plan, str) else plan
        check_count("tensor_parallel", tensor_parallel)
        trace = trace_model(model, sample_batch)

        def planned():
            return plan_from_trace(
                model,
                tensor_parallel,
                trace,
                runtime.local_ranks,
                layout_map,
                _held_layers(model, held),
                runtime.stores_blocks,
            )

        bound = planned()
        by_xla = bound.summed_by_xla
        by_blocks = bound.paired_by_blocks
        if (
            (by_xla or by_blocks)
            and isinstance(runtime, MeshRuntime)
            and not runtime.per_rank_steps
            and runtime.run_steps_per_rank()
        ):
            per_rank = planned()
            if by_xla or per_rank.variable_blocks():
                logger.info(
                    "Steps run per rank: on global arrays XLA would sum the "
                    "gradients of %s in collectives of its own, and the "
                    "Columns of %s could not pair by blocks.",
                    ", ".join(by_xla) or "no layer",
                    ", ".join(by_blocks) or "no layer",
                )
                bound = per_rank
                bound.summed_by_xla = by_xla
            else:
                # Its blocks fell back per rank too (code between them
                # that needs whole values): the steps stay on global arrays.
                runtime.run_steps_per_rank(per_rank=False)
    elif isinstance(plan, (ShardingPlan, dict, list, tuple)):
        rules = plan.rules if isinstance(plan, ShardingPlan) else plan
        bound = ShardingPlan(rules).bind(model, tensor_parallel)
        bound.sources = {e.layer.path: "user plan" for e in bound.layers}
        _check_not_held(bound, held)
        if (
            bound.variable_blocks()
            and isinstance(runtime, MeshRuntime)
            and not runtime.per_rank_steps
        ):
            # JAX stores blocked splits where its steps run per rank.
            runtime.run_steps_per_rank()
        _check_blocks_stored(bound, runtime)
        if runtime.local_ranks and tensor_parallel > 1:
            check_locally(model, bound, sample_batch)
    else:
        raise TypeError(
            "plan must be 'auto', a ShardingPlan, a dict or a "
            f"keras.distribution.LayoutMap, got {type(plan)}."
        )
    if tensor_parallel == 1:
        # Splitting over one rank changes nothing but would still issue
        # collectives over the model axis: every layer stays whole.
        bound = ShardingPlan().bind(model, 1)
        reason = (
            "one tensor-parallel rank: nothing to split"
            if runtime.pipeline_parallel == 1
            else "whole on its pipeline stage"
        )
        bound.replicated = {path: reason for path in bound.replicated}
    return bound


def _held_layers(model, held):
    """`{layer path: reason}` of the layers whose weights a constant of
    the model's graph reads (`Runtime.weights_held_by_graph`)."""
    return {
        layer.path: (
            "a tensor computed from its weights when the model was built "
            f"is an argument of '{held[id(variable)]}' in the model's "
            "graph, which would keep reading the whole weights"
        )
        for layer in sublayers(model)
        for variable in own_variables(layer)
        if id(variable) in held
    }


def _check_not_held(plan, held):
    """Refuses a plan that splits a weight a graph constant reads."""
    for variable, _ in plan.split_variables():
        if id(variable) in held:
            raise ShardingError(
                f"The plan splits variable '{variable.path}', but a tensor "
                "computed from it when the model was built is an argument "
                f"of '{held[id(variable)]}' in the model's graph, and would "
                "keep reading the whole variable. Keep its layer whole "
                "(Replicate()), or use plan='auto', which does."
            )


def _check_blocks_stored(plan, runtime):
    """Refuses a plan that splits by blocks where the runtime cannot."""
    if runtime.stores_blocks:
        return
    for entry in plan.leaf_layers():
        if getattr(entry.style, "blocks", 1) > 1:
            raise ShardingError(
                f"The plan splits layer '{entry.layer.path}' as "
                f"{entry.style!r}, which this runtime cannot store yet "
                "(it splits by blocks on torch, TensorFlow and JAX, without "
                "pipeline stages). "
                "Use Column(gather_output=True) for it, or plan='auto', "
                "which does."
            )


def split_model(model, plan, runtime, trainer):
    """Places `model`'s variables as the bound `plan` splits them, runs
    its split layers through the runtime, and prepares `trainer` (the
    `TensorParallelKeras`) to run the steps."""
    axes = {id(variable): axis for variable, axis in plan.split_variables()}
    blocks = plan.variable_blocks()
    # The losses of the last call (the planner's trace) would keep its
    # graph, and the whole weights, alive.
    clear_added_losses(model)
    runtime.equalize_values(model.variables)
    for variable in model.variables:
        runtime.placement.place(
            variable, axes.get(id(variable)), blocks.get(id(variable), 1)
        )
    installed = []
    for part, part_runtime in runtime.stage_plans(plan):
        installed += regions.install(part, part_runtime)
        partial_gradients.install(part, part_runtime)
        split_regularizers.install(part, part_runtime)
    if runtime.pipeline_parallel == 1:
        # Pipelines do not generate (`generation.generate` says why).
        generation.install_caches(model, plan, runtime)
    runtime.prepare_model(model)
    runtime.prepare_trainer(trainer)
    batch_statistics.install(model, runtime, trainer)
    if runtime.zero_stage == 3:
        for variable in model.trainable_variables:
            axis = runtime.placement.partition_axis(variable)
            if axis is not None:
                split_regularizers.check_unpartitioned(variable)
                runtime.placement.partition(variable, axis)
        zero3.install_gathers(model, installed, runtime)
    _WRAPPED_MODELS.add(model)
