"""`auto_plan`: a Megatron plan decided from shapes and the dataflow.

One pipeline, in one direction:

1. **Trace** the model once on a probe batch (`trace.trace_model`): every
   layer call, its parent call, and which call produced which tensor.
2. **Decide** (`planner.Planner`): group the splittable layers of each
   parent call (and a Column's output that another parent's Row reads
   directly) into Megatron pairs (`pairing.MegatronPairing`): Column
   layers whose outputs reach one Row layer, either directly or through
   layers that keep features apart (activations, dropout, pooling, a
   BatchNorm split with the channels), or through raw tensor ops inside
   the parent (a gate multiply, a rotary embedding, the attention core),
   recognised by the split width; then the model's own layout map, expert
   banks and fallbacks.
3. **Check** (where ranks run the code between split layers on their own
   slices: torch, TensorFlow, JAX with a data axis) that every rank's view
   of the model gives the one-device numbers (`verify.local_problems`),
   and fall back, group by group, with the reason, where it does not.
   Elsewhere the attention units alone are checked: each still runs on a
   rank's heads.
4. **Emit** a bound `ShardingPlan`, each layer's source and reasons kept.
"""

import logging
import warnings

from keras_tp.errors import check_count
from keras_tp.plan import trace as tracing
from keras_tp.plan.attention import ATTENTION
from keras_tp.plan.feature_arguments import add_feature_arguments
from keras_tp.plan.head_counts import add_head_arguments
from keras_tp.plan.layers import leaf_handler
from keras_tp.plan.local_check import counted_problems
from keras_tp.plan.local_check import keep_needed_counts
from keras_tp.plan.local_check import on_global_arrays
from keras_tp.plan.local_check import random_on_split_values
from keras_tp.plan.planner import Planner
from keras_tp.plan.rank_widths import add_rank_widths
from keras_tp.plan.sharding_plan import ShardingPlan
from keras_tp.plan.styles import Replicate
from keras_tp.plan.verify import Problem

logger = logging.getLogger(__name__)


def auto_plan(
    model,
    tensor_parallel=None,
    check_local=True,
    world_size=None,
    layout_map=None,
    sample_batch=None,
    keep_whole=None,
    blocks=False,
):
    """Returns the plan `TensorParallelKeras(model, plan="auto")` applies.

    The planner runs the model once on a small probe batch and records
    every layer call. In each block it pairs the Column layers with the Row
    layer their outputs reach (an MLP's up and down projections, a gated
    MLP's gate and up with its down projection, attention's query, key and
    value with its output projection), as Megatron does: a block costs one
    all-reduce forward and one backward. Decisions come from shapes and the
    dataflow, not from layer names. Embeddings are split by vocabulary rows;
    a `ReversibleEmbedding` used as the LM head shares that split and
    gathers the logits. A supported layer left unpaired is split as a
    Column that gathers its output, or else as a Row that slices its input,
    so its memory is still divided. Layers the planner does not support, and
    dimensions that do not divide by `tensor_parallel`, stay replicated, with
    the reason in `plan.replicated`.

    With `check_local=True` the plan is also checked for ranks that run the
    code between split layers on their own slices (torch, TensorFlow, JAX
    with a data axis): on one device, every rank's view of the model must
    give the one-device numbers. A pairing that fails falls back to
    gathering Column / slicing Row layers, and a layer whose weights are
    read outside its own call stays whole; `plan.fallbacks` says why.

    Args:
        model: a built Keras model (Sequential, Functional or subclassed).
        tensor_parallel: number of tensor-parallel ranks (the `model` axis
            of the mesh).
        check_local: whether to check the plan for ranks that hold their
            own slices (see above). JAX without a data axis runs that code
            on global arrays: only its attention units, which run on each
            rank's heads, are checked.
        world_size: the former name of `tensor_parallel`; deprecated.
        layout_map: a `keras.distribution.LayoutMap` (as written for
            `ModelParallel`) that decides which layers split: those it
            splits on the `model` axis, with Megatron's styles; the rest
            stay whole.
        sample_batch: a few rows of the model's inputs to trace it on;
            default: a probe batch made from its input shapes, with every
            unknown dimension 8 (128, then 1024, where the model fails on
            8). Pass one when the model needs other sizes (a text length
            the model fixes).
        keep_whole: `{layer path: reason}` of layers that stay whole,
            with the reason in `plan.fallbacks` (`TensorParallelKeras`
            passes those whose weights a constant of the model's graph
            reads).
        blocks: whether a fused projection laid out block by block (a
            query-key-value projection reshaped to `(..., 3, heads,
            head_dim)`, a gate-and-up projection) pairs with its Row as
            `Column(blocks=b)`, each rank holding its part of each block,
            where the runtime stores such splits (`TensorParallelKeras`
            passes whether it does); else it gathers its output.

    Returns:
        A `ShardingPlan` bound to `model`.

    Example:

    >>> plan = keras_tp.auto_plan(model, tensor_parallel=2)
    >>> print(plan)
    """
    if world_size is not None:
        warnings.warn(
            "auto_plan(world_size=...) is now auto_plan(tensor_parallel=...): "
            "the plan's size is the model axis of the mesh, not all devices.",
            DeprecationWarning,
            stacklevel=2,
        )
        if tensor_parallel is not None:
            raise TypeError(
                "Pass tensor_parallel only; world_size is its former name."
            )
        tensor_parallel = world_size
    if tensor_parallel is None:
        raise TypeError(
            "auto_plan() is missing tensor_parallel, the number of ranks to "
            "split over."
        )
    check_count("tensor_parallel", tensor_parallel)
    trace = tracing.trace_model(model, sample_batch)
    return plan_from_trace(
        model,
        tensor_parallel,
        trace,
        check_local,
        layout_map,
        keep_whole,
        blocks,
    )


def plan_from_trace(
    model,
    tensor_parallel,
    trace,
    check_local,
    layout_map=None,
    keep_whole=None,
    blocks=False,
):
    """`auto_plan` on a trace of `model` made already (`trace_model`): a
    runtime that plans again for per-rank steps traces the model once."""
    planner = Planner(model, tensor_parallel, trace, layout_map, blocks)
    decisions = planner.decide()
    fallbacks = {}
    for path, reason in (keep_whole or {}).items():
        planner.demote(decisions, path, Problem(reason, True), fallbacks)
    _keep_traced_calls_whole(planner, decisions, trace, fallbacks)
    _keep_shared_paths_alike(planner, decisions, fallbacks)
    if tensor_parallel > 1:
        random_inputs = {}
        for _ in range(len(decisions) + 1):
            plan = _emit(
                model, tensor_parallel, decisions, fallbacks, planner.reasons
            )
            plan.paired_by_blocks = list(planner.paired_by_blocks)
            plan.per_rank_counts.update(planner.local_reshapes(decisions))
            group_of = _group_of(decisions)
            add_head_arguments(model, plan, trace)
            add_feature_arguments(model, plan, trace)
            add_rank_widths(model, plan, trace)
            if check_local:
                plan.summed_gradients = planner.whole_key_values(decisions)
            # On whole arrays only the attention units run on a rank's
            # heads: their check alone.
            units_only = not check_local
            problems = counted_problems(
                model, plan, trace, group_of, random_inputs, units_only
            )
            if not (problems or check_local):
                problems, plan.summed_gradients, plan.summed_by_xla = (
                    on_global_arrays(
                        model,
                        plan,
                        trace,
                        group_of,
                        planner.whole_key_values(decisions),
                    )
                )
            if not problems:
                if check_local:
                    plan.per_rank_random = random_on_split_values(
                        plan, random_inputs
                    )
                keep_needed_counts(model, plan, trace, group_of, units_only)
                return plan
            for key, problem in problems.items():
                planner.demote(decisions, key, problem, fallbacks)
    plan = _emit(model, tensor_parallel, decisions, fallbacks, planner.reasons)
    plan.paired_by_blocks = list(planner.paired_by_blocks)
    return plan


def _styles(decisions):
    """`[(variable path, style, decision), ...]` of every leaf layer the
    decisions split or keep whole, attention projections included."""
    styles = []
    for decision in decisions.values():
        layer = decision.layer
        if ATTENTION.matches(layer):
            for name, sub in ATTENTION.projections(layer).items():
                style = (
                    decision.style
                    if isinstance(decision.style, Replicate)
                    else ATTENTION.projection_style(name)
                )
                styles.append((_primary_path(sub), style, decision))
        else:
            styles.append((_primary_path(layer), decision.style, decision))
    return styles


def _keep_traced_calls_whole(planner, decisions, trace, fallbacks):
    """Keeps whole the groups of the layers a control-flow op traced.

    JAX's `ops.cond` traces both branches, even on the eager probe batch;
    `ops.scan` and `ops.while_loop` trace their bodies. A layer called
    there ran on tracers, not values, and the checks that decide whether
    raw ops carry each rank's part (`dependence`) and whether each rank's
    view gives the one-device numbers (`verify`) read and rerun recorded
    values. Whole, such a layer is right wherever it runs; its group's
    other layers stay whole with it, so none expects its split.
    """
    traced = trace.abstract_layers()
    if not traced:
        return
    problem = Problem(
        "it runs inside a control-flow op that the backend traces (such as "
        "ops.cond on JAX), where keras_tp cannot check a split of it",
        True,
    )
    group_of = _group_of(decisions)
    for group in {group_of[key] for key in traced if key in group_of}:
        planner.demote(decisions, group, problem, fallbacks)


def _keep_shared_paths_alike(planner, decisions, fallbacks):
    """Keeps whole the layers whose variable path another layer shares
    with another style.

    A plan maps variable paths to styles, and two sub-models whose layers
    have the same names (CLIP's vision and text encoders) give their
    variables the same paths: such layers must be split alike, or the plan
    would apply one's style to both.
    """
    problem = Problem(
        "another layer's variables have the same paths and another split, "
        "and a plan maps paths to styles",
        False,
    )
    for _ in range(len(decisions) + 1):
        seen = {}
        groups = set()
        for path, style, decision in _styles(decisions):
            other_style, other = seen.setdefault(path, (repr(style), decision))
            if other_style != repr(style):
                groups.update((decision.group, other.group))
        if not groups:
            return
        # A group falls back to gathering Columns and slicing Rows, then,
        # if its twin still differs, stays whole.
        for group in groups:
            planner.demote(decisions, group, problem, fallbacks)


def _emit(model, tensor_parallel, decisions, fallbacks, reasons):
    rules = {path: style for path, style, _ in _styles(decisions)}
    plan = ShardingPlan(rules).bind(model, tensor_parallel)
    plan.sources = {
        d.layer.path: d.source
        for d in decisions.values()
        if not isinstance(d.style, Replicate)
    }
    plan.fallbacks = dict(fallbacks)
    for path in plan.replicated:
        if path in reasons:
            plan.replicated[path] = reasons[path]
    for decision in decisions.values():
        path = decision.layer.path
        if isinstance(decision.style, Replicate):
            plan.replicated[path] = fallbacks.get(path) or reasons.get(
                path, "kept whole"
            )
    return plan


def _group_of(decisions):
    """`{id(leaf layer): group}`, the projections of units included."""
    groups = {}
    for decision in decisions.values():
        groups[id(decision.layer)] = decision.group
        if ATTENTION.matches(decision.layer):
            for sub in ATTENTION.projections(decision.layer).values():
                groups[id(sub)] = decision.group
    return groups


def _primary_path(layer):
    handler = leaf_handler(layer)
    return handler.primary_variable(layer).path
