"""`auto_plan`: a Megatron plan decided from shapes and the dataflow.

One pipeline, in one direction:

1. **Trace** the model once on a probe batch (`trace.trace_model`): every
   layer call, its parent call, and which call produced which tensor.
2. **Group** the splittable layers of each parent call into Megatron
   pairs: Column layers whose outputs reach one Row layer, either directly
   or through layers that keep features apart (activations, dropout,
   pooling), or through raw tensor ops inside the parent (a gate multiply,
   a rotary embedding, the attention core), recognised by the split width.
3. **Check** (where ranks run the code between split layers on their own
   slices: torch, TensorFlow, JAX with a data axis) that every rank's view
   of the model gives the one-device numbers (`verify.local_problems`),
   and fall back, group by group, with the reason, where it does not.
4. **Emit** a bound `ShardingPlan`, each layer's source and reasons kept.
"""

import collections
import logging
import warnings

import keras
import numpy as np
from keras import ops

from keras_tp.plan import trace as tracing
from keras_tp.plan.layers import ATTENTION
from keras_tp.plan.layers import ShardingError
from keras_tp.plan.layers import leaf_handler
from keras_tp.plan.sharding_plan import ShardingPlan
from keras_tp.plan.sharding_plan import check_shardable
from keras_tp.plan.sharding_plan import supported_layers
from keras_tp.plan.styles import Channelwise
from keras_tp.plan.styles import Column
from keras_tp.plan.styles import ExpertParallel
from keras_tp.plan.styles import Replicate
from keras_tp.plan.styles import Row
from keras_tp.plan.styles import Vocab
from keras_tp.plan.verify import Problem
from keras_tp.plan.verify import expert_output_axis
from keras_tp.plan.verify import local_problems

logger = logging.getLogger(__name__)

_PAIRED = "auto: Column -> Row"
_FALLBACKS = (Vocab(), Column(gather_output=True), Row(input_is_parallel=False))


def auto_plan(model, tensor_parallel=None, check_local=True, world_size=None):
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
            on global arrays and needs no check.
        world_size: the former name of `tensor_parallel`; deprecated.

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
    if tensor_parallel < 1:
        raise ValueError(
            f"tensor_parallel must be >= 1, got {tensor_parallel}."
        )
    trace = tracing.trace_model(model)
    planner = _Planner(model, tensor_parallel, trace)
    decisions = planner.decide()
    fallbacks = {}
    if check_local and tensor_parallel > 1:
        planner.demote_whole_key_values(decisions, fallbacks)
        for _ in range(len(decisions) + 1):
            plan = _emit(
                model, tensor_parallel, decisions, fallbacks, planner.reasons
            )
            problems = local_problems(model, plan, trace, _group_of(decisions))
            if not problems:
                break
            for key, problem in problems.items():
                planner.demote(decisions, key, problem, fallbacks)
    return _emit(model, tensor_parallel, decisions, fallbacks, planner.reasons)


Decision = collections.namedtuple(
    "Decision",
    ["layer", "style", "group", "source", "paired"],
    defaults=[False],
)
Decision.__doc__ = """How one supported layer (or attention unit) is split:
its style, the id of its Megatron group (layers paired together fall back
together), what decided it, and whether it is in a Column -> Row pair."""


def _emit(model, tensor_parallel, decisions, fallbacks, reasons):
    rules = {}
    for decision in decisions.values():
        layer = decision.layer
        if ATTENTION.matches(layer):
            for name, sub in ATTENTION.projections(layer).items():
                style = (
                    decision.style
                    if isinstance(decision.style, Replicate)
                    else ATTENTION.projection_style(name)
                )
                rules[_primary_path(sub)] = style
        else:
            rules[_primary_path(layer)] = decision.style
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


def model_layout_map(model, tensor_parallel):
    """The `keras.distribution.LayoutMap` the model ships, or `None`.

    keras-hub backbones of some families have a static `get_layout_map`;
    a task model reaches it through its `backbone`.
    """
    owner = model if hasattr(model, "get_layout_map") else None
    if owner is None:
        owner = getattr(model, "backbone", None)
    get_layout_map = getattr(owner, "get_layout_map", None)
    if get_layout_map is None:
        return None
    # The map is only read, never applied: the devices are names.
    mesh = keras.distribution.DeviceMesh(
        shape=(1, tensor_parallel),
        axis_names=("batch", "model"),
        devices=[f"cpu:{i}" for i in range(tensor_parallel)],
    )
    try:
        return get_layout_map(mesh)
    except (TypeError, ValueError) as error:
        logger.info("The layout map of %s is not usable: %s", owner, error)
        return None


def _model_axis(axes):
    for axis, name in enumerate(axes):
        if name == "model" or (isinstance(name, tuple) and "model" in name):
            return axis
    return None


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


class _Planner:
    def __init__(self, model, tensor_parallel, trace):
        self.model = model
        self.tensor_parallel = tensor_parallel
        self.trace = trace
        self.reasons = {}
        # Groups fed by a whole layer (key/value heads fewer than ranks).
        self.whole_inputs = {}
        # Per-channel layers with weights a Column's output passes through
        # on its way to its Row, by the Column call's index.
        self.through = {}

    # Deciding ---------------------------------------------------------

    def decide(self):
        """`{id(layer): Decision}` for every layer that is split."""
        decisions = {}
        leaves = []
        for layer in supported_layers(self.model):
            if ATTENTION.matches(layer):
                reason = self._attention_reason(layer)
                if reason is None:
                    decisions[id(layer)] = Decision(
                        layer, Column(), id(layer), "auto: attention heads"
                    )
                else:
                    self.reasons[layer.path] = reason
            else:
                leaves.append(layer)
        candidates = {id(layer) for layer in leaves}
        for parent in self.trace.children:
            groups, whole = self._groups(
                self.trace.children[parent], candidates
            )
            for columns, row in groups:
                key = id(row.layer)
                for call in columns:
                    decisions[id(call.layer)] = Decision(
                        call.layer, Column(), key, _PAIRED, True
                    )
                    for layer in self.through.get(call.index, ()):
                        decisions[id(layer)] = Decision(
                            layer, Channelwise(), key, _PAIRED, True
                        )
                decisions[key] = Decision(row.layer, Row(), key, _PAIRED, True)
            for call, key in whole:
                decisions[id(call.layer)] = Decision(
                    call.layer, Replicate(), id(call.layer), "auto: whole"
                )
                self.whole_inputs[key] = call.layer.path
        self._apply_layout_map(decisions, leaves)
        for layer in leaves:
            if id(layer) in decisions:
                continue
            if not self.trace.calls_of[id(layer)]:
                # A quantized layer runs `quantized_call`, not `call`.
                handler = leaf_handler(layer)
                self.reasons[layer.path] = (
                    handler.unsupported_reason(layer)
                    or "not called when the model ran"
                )
                continue
            style = self._fallback_style(layer, ()) or self._expert_style(layer)
            if style is not None:
                decisions[id(layer)] = Decision(
                    layer, style, id(layer), "auto: alone"
                )
            elif ExpertParallel in leaf_handler(layer).styles:
                self.reasons.setdefault(
                    layer.path,
                    f"{type(layer).__name__}: kept whole, as no split of "
                    "its own weights gives its output (by channels between "
                    "a Column and its Row, or by experts)",
                )
        return decisions

    def _expert_style(self, layer):
        """`ExpertParallel` if splitting the layer's experts is exact.

        Checked on the traced call: the ranks' outputs, each from its share
        of the experts, must gather (or sum) to the one-device output.
        """
        handler = leaf_handler(layer)
        calls = self.trace.calls_of[id(layer)]
        if ExpertParallel not in handler.styles or len(calls) != 1:
            return None
        if not self._can_split(layer, ExpertParallel()):
            return None
        found, axis = expert_output_axis(
            calls[0], handler, self.tensor_parallel
        )
        if not found:
            return None
        self.reasons.pop(layer.path, None)
        return ExpertParallel(output_axis=axis)

    def _apply_layout_map(self, decisions, leaves):
        """The model's own layout map decides the layers it lists.

        keras-hub ships one for some families (`get_layout_map()` on Gemma,
        Llama, Qwen): the model authors' choice of which weights to split
        on the `model` axis. A listed layer is split where the map splits
        it and kept whole where the map does; its style is the Megatron
        pairing's when the planner found one (a GSPMD layout may name
        another axis of the same pair, which GSPMD reconciles with extra
        collectives), else the style of the axis the map names.
        """
        layout_map = model_layout_map(self.model, self.tensor_parallel)
        if layout_map is None:
            return
        for layer in leaves:
            handler = leaf_handler(layer)
            path = handler.primary_variable(layer).path
            layout = layout_map[path]
            if layout is None:
                continue
            axis = _model_axis(layout.axes)
            decision = decisions.get(id(layer))
            source = "model layout map"
            if axis is None:
                self.reasons[layer.path] = "kept whole by the model layout map"
                decisions[id(layer)] = Decision(
                    layer, Replicate(), id(layer), source
                )
            elif decision is not None and not isinstance(
                decision.style, Replicate
            ):
                split = handler.split_axes(layer, decision.style)
                if split[handler.primary_role(layer)] != axis:
                    source += " (Megatron axis)"
                decisions[id(layer)] = decision._replace(source=source)
            else:
                style = self._style_of_axis(layer, axis)
                if style is not None:
                    decisions[id(layer)] = Decision(
                        layer, style, id(layer), source
                    )

    def _style_of_axis(self, layer, axis):
        """The unpaired style splitting `layer`'s main variable on `axis`."""
        handler = leaf_handler(layer)
        for style in _FALLBACKS:
            if not isinstance(style, handler.styles):
                continue
            role = handler.primary_role(layer)
            if handler.split_axes(layer, style)[role] != axis:
                continue
            if self._can_split(layer, style):
                self.reasons.pop(layer.path, None)
                return style
        return None

    def _groups(self, calls, candidates):
        """Megatron groups among the direct child calls of one parent.

        Walks the calls in order, keeping the Column candidates whose
        output is still open. A Row candidate closes the open Columns its
        input comes from: directly (through separable layers) or, when its
        input was made by raw ops, every open Column whose output only raw
        ops read, provided one of them has the Row's split width.

        Returns:
            `(groups, whole)`: `[(column calls, row call)]`, and the calls
            that feed a group through raw ops but cannot be split on its
            axis (key/value heads fewer than the ranks): they stay whole,
            as Megatron keeps them.
        """
        open_columns = []
        unsplit = []
        groups = []
        whole = []
        for call in calls:
            if not self._single_call_candidate(call, candidates):
                continue
            if self._can_split(call.layer, Row()):
                partners = self._row_partners(call, open_columns)
                if partners:
                    groups.append(([c for c, _ in partners], call))
                    open_columns = [
                        c for c in open_columns if c not in partners
                    ]
                    if any(not s for _, s in partners):
                        whole.extend((c, id(call.layer)) for c in unsplit)
                    unsplit = []
                    continue
            if Column not in leaf_handler(call.layer).styles:
                continue
            consumers = self._span_consumers(call)
            if consumers == set():
                if self._can_split(call.layer, Column()):
                    open_columns.append((call, consumers))
                else:
                    unsplit.append(call)
            elif consumers and self._can_split(call.layer, Column()):
                open_columns.append((call, consumers))
        for call, _ in whole:
            self.reasons[call.layer.path] = (
                "its output meets split heads through raw ops but "
                f"{self._split_size(call)} does not divide by "
                f"tensor_parallel={self.tensor_parallel}; kept whole, as "
                "Megatron keeps key/value heads fewer than the ranks"
            )
        return groups, whole

    def _split_size(self, call):
        return leaf_handler(call.layer).split_size(call.layer, Column())

    def _row_partners(self, row, open_columns):
        width = leaf_handler(row.layer).split_size(row.layer, Row())
        direct = [
            (call, consumers)
            for call, consumers in open_columns
            if consumers and row.index in consumers
        ]
        if direct:
            if all(self._width(call) == width for call, _ in direct):
                return direct
            return []
        producer = row.inputs and self.trace.producer.get(id(row.inputs[0]))
        if producer and not _opaque(producer.layer):
            return []  # its input comes from a recorded, unpaired layer
        opaque = [(c, s) for c, s in open_columns if not s]
        if any(self._width(call) == width for call, _ in opaque):
            return opaque
        return []

    def _width(self, call):
        handler = leaf_handler(call.layer)
        output = call.outputs[0]
        axis = handler.output_axis(call.layer, Column(), len(output.shape))
        return output.shape[axis]

    def _span_consumers(self, call):
        """Indices of the non-separable calls reading `call`'s output.

        Follows the output through layers that keep the split features
        apart (activations, dropout, pooling, a norm over another axis),
        each call once and only forward in time, so the walk ends. Returns
        an empty set when only raw ops read it, or `None` when a consumer
        is not a Row candidate (the output must be gathered).
        """
        if len(call.outputs) != 1:
            return None
        output = call.outputs[0]
        axis = leaf_handler(call.layer).output_axis(
            call.layer, Column(), len(output.shape)
        )
        ends = set()
        seen = set()
        through = []
        tensors = [output]
        while tensors:
            tensor = tensors.pop()
            for consumer in self.trace.consumers[id(tensor)]:
                if consumer.index <= call.index or consumer.index in seen:
                    continue
                seen.add(consumer.index)
                if call.index in self.trace.ancestors(consumer):
                    continue  # inside the Column layer's own call
                if _opaque(consumer.layer):
                    continue  # like raw ops: the check decides
                handler = leaf_handler(consumer.layer)
                weights = self._weights_passing(consumer, tensor, axis)
                if weights is not None:
                    if weights:
                        through.append(consumer.layer)
                    tensors.extend(
                        t for t in consumer.outputs if t is not tensor
                    )
                    continue
                if handler is None or Row not in handler.styles:
                    return None
                if not consumer.inputs or consumer.inputs[0] is not tensor:
                    return None
                ends.add(consumer.index)
        self.through[call.index] = through
        return ends

    def _weights_passing(self, call, tensor, axis):
        """How split features on `axis` of `tensor` pass `call`'s layer.

        Returns `None` if they do not, or the layer's weights split with
        them (`{role: slice}`, for a per-channel layer such as
        BatchNormalization, called once), or `{}` if the layer keeps them
        apart with its weights whole (an activation; a norm over another
        axis, whose weights the local-execution check then judges).
        """
        handler = leaf_handler(call.layer)
        if handler is not None and Channelwise not in handler.styles:
            return None
        part = np.arange(tensor.shape[axis] // 2)
        if (
            handler is not None
            and handler.channel_length(call.layer) == tensor.shape[axis]
            and len(self.trace.calls_of[id(call.layer)]) == 1
            and self._can_split(call.layer, Channelwise())
        ):
            axes = handler.split_axes(call.layer, Channelwise())
            weights = {
                role: _take(variable, part, axes[role])
                for role, variable in handler.variables(call.layer).items()
            }
            if _commutes(call, tensor, axis, weights):
                return weights
        return {} if _commutes(call, tensor, axis) else None

    def _single_call_candidate(self, call, candidates):
        return (
            id(call.layer) in candidates
            and len(self.trace.calls_of[id(call.layer)]) == 1
            and call.outputs
        )

    def _can_split(self, layer, style):
        handler = leaf_handler(layer)
        if not isinstance(style, handler.styles):
            return False
        try:
            check_shardable(layer, handler, style, self.tensor_parallel)
        except ShardingError as error:
            self.reasons.setdefault(layer.path, str(error))
            return False
        return True

    def _fallback_style(self, layer, exclude):
        for style in _FALLBACKS:
            if style in exclude:
                continue
            if isinstance(
                style, leaf_handler(layer).styles
            ) and self._can_split(layer, style):
                self.reasons.pop(layer.path, None)
                return style
        return None

    def _attention_reason(self, layer):
        query_heads, kv_heads = ATTENTION.heads(layer)
        if (
            query_heads % self.tensor_parallel
            or kv_heads % self.tensor_parallel
        ):
            return (
                f"{query_heads} query and {kv_heads} key/value heads do not "
                f"divide by tensor_parallel={self.tensor_parallel}"
            )
        for name, sub in ATTENTION.projections(layer).items():
            handler = leaf_handler(sub)
            try:
                check_shardable(
                    sub,
                    handler,
                    ATTENTION.projection_style(name),
                    self.tensor_parallel,
                )
            except ShardingError as error:
                return str(error)
        return None

    # Falling back -----------------------------------------------------

    def demote_whole_key_values(self, decisions, fallbacks):
        """Falls back the groups fed by whole key/value projections.

        Where ranks hold their own slices, a rank holding some query heads
        would compute only part of the gradient of a whole key/value
        projection; the local check sees forward values, not that.
        """
        for key in self.whole_inputs:
            if not any(d.group == key and d.paired for d in decisions.values()):
                continue  # fell back with a group of the same shape
            self.demote(
                decisions,
                key,
                Problem(
                    "its key/value projections stay whole (fewer heads than "
                    "ranks) and meet its split query heads through raw ops: "
                    "a rank holding some query heads would compute a partial "
                    "gradient for them",
                    False,
                ),
                fallbacks,
            )

    def demote(self, decisions, key, problem, fallbacks):
        """Falls back the group `key` (or the layer path `key`) names.

        A group whose pairing failed becomes gathering Columns and slicing
        Rows, and so does every group of the same shape (the other blocks
        of a stack); a layer that already fell back, or whose weights are
        read outside its call, stays whole.
        """
        members = [
            d
            for d in decisions.values()
            if d.group == key or d.layer.path == key
        ]
        if not problem.whole and members:
            signature = _signature(members, decisions)
            groups = {d.group for d in decisions.values()}
            for group in groups:
                same = [d for d in decisions.values() if d.group == group]
                if group != key and _signature(same, decisions) == signature:
                    members += same
        for decision in members:
            layer = decision.layer
            fallbacks[layer.path] = problem.reason
            paired = decision.paired
            style = None
            if paired and not problem.whole and not ATTENTION.matches(layer):
                style = self._fallback_style(layer, (Vocab(),))
            if style is None:
                style = Replicate()
            decisions[id(layer)] = Decision(
                layer, style, id(layer), "auto: fallback"
            )


def _signature(members, decisions):
    """What a group looks like: layer types, weight shapes and styles."""
    return sorted(
        (
            type(d.layer).__name__,
            tuple(tuple(v.shape) for v in d.layer.weights),
            repr(d.style),
        )
        for d in members
    )


def _opaque(layer):
    """A layer of another library with no weights: read like raw ops.

    Keras' own layers are known to the planner; a weightless layer from
    elsewhere (a rotary embedding, say) may or may not keep the split
    features apart, which only the local-execution check can tell.
    """
    return not layer.weights and not type(layer).__module__.startswith("keras.")


def _take(tensor, indices, axis):
    return ops.convert_to_tensor(
        np.take(ops.convert_to_numpy(tensor), indices, axis),
        dtype=tensor.dtype,
    )


def _commutes(call, tensor, axis, weights=None):
    """Whether `call`'s layer keeps the features on `axis` apart, in place.

    Decided by what the layer computes on the traced values: run on the
    first half of `tensor` along `axis` (with its weights read as
    `weights`, their matching halves, if given), it must give the same
    half of its traced output (an activation, dropout, pooling over other
    axes, a norm over another axis, BatchNormalization with its weights
    halved do; a norm over `axis`, a reshape do not).
    """
    if len(call.inputs) != 1 or len(call.outputs) != 1:
        return False
    output = call.outputs[0]
    if tuple(output.shape) != tuple(tensor.shape) or tensor.shape[axis] < 2:
        return False
    part = np.arange(tensor.shape[axis] // 2)
    try:
        sliced = _take(tensor, part, axis)
        if weights:
            handler = leaf_handler(call.layer)
            actual = handler.run_local(call.layer, weights, (sliced,), {})
        else:
            actual = call.layer.call(sliced)
        actual = ops.convert_to_numpy(actual)
    except Exception:  # noqa: BLE001 - the layer cannot run on a slice
        return False
    expected = np.take(ops.convert_to_numpy(output), part, axis)
    return actual.shape == expected.shape and bool(
        np.allclose(actual, expected, rtol=1e-4, atol=1e-5)
    )
