"""The automatic planner's decisions: which style each layer gets.

`Planner.decide()` reads the trace: attention units split by heads,
Megatron pairs (found by `MegatronPairing`), the model's own layout map
(`LayoutMapRules`), expert banks, and fallbacks for the rest; `demote()`
falls a group back when the local-execution check finds a problem.
"""

from keras_tp.errors import ShardingError
from keras_tp.plan.attention import ATTENTION
from keras_tp.plan.experts import expert_output_axis
from keras_tp.plan.layers import leaf_handler
from keras_tp.plan.layout_maps import LayoutMapRules
from keras_tp.plan.pairing import MegatronPairing
from keras_tp.plan.sharding_plan import SummedCall
from keras_tp.plan.sharding_plan import check_shardable
from keras_tp.plan.sharding_plan import supported_layers
from keras_tp.plan.styles import Channelwise
from keras_tp.plan.styles import Column
from keras_tp.plan.styles import Decision
from keras_tp.plan.styles import ExpertParallel
from keras_tp.plan.styles import Replicate
from keras_tp.plan.styles import Row
from keras_tp.plan.styles import Vocab
from keras_tp.tensors import nbytes

_PAIRED = "auto: Column -> Row"
# A layer no Megatron pair splits, whose weights are under this share of
# the model's, stays whole: split alone, it would cost a collective at
# every call (a MoE router's all-gather in every block) to save almost no
# memory. Megatron-LM and torchtitan keep such layers whole.
NEGLIGIBLE_SHARE = 0.01
_FALLBACKS = (Vocab(), Column(gather_output=True), Row(input_is_parallel=False))


class Planner(LayoutMapRules, MegatronPairing):
    """Decides the style of every splittable layer of a traced model.

    Args:
        model: the model.
        tensor_parallel: the number of ranks.
        trace: the model's `Trace` on the probe batch.
        layout_map: a `keras.distribution.LayoutMap` given as the plan:
            it decides every layer, and what it does not list stays whole.
            `None`: the model's own map decides the layers it lists.
        blocks: whether fused projections may pair as `Column(blocks=b)`.
    """

    def __init__(
        self,
        model,
        tensor_parallel,
        trace,
        layout_map=None,
        blocks=False,
    ):
        self.model = model
        self.tensor_parallel = tensor_parallel
        self.trace = trace
        self.layout_map = layout_map
        self.model_bytes = sum(map(nbytes, model.weights)) or 1
        self.reasons = {}
        # Groups fed by a whole layer (key/value heads fewer than ranks).
        self.whole_inputs = {}
        # Per-channel layers with weights a Column's output passes through
        # on its way to its Row, by the Column call's index.
        self.through = {}
        # The `Reshape` layers it passes on the way, by the same index,
        # with the target shape a rank reshapes its features to.
        self.reshapes = {}
        # The values those walks found split (`id`s), and the Column
        # calls whose walk met a gate made by raw ops.
        self.split_tensors = set()
        self.raw_gated = set()
        # The Megatron group of each paired Column call, by its index.
        self.group_of_column = {}
        # Columns paired by blocks (and the Rows that would pair so
        # where `blocks` is `False`).
        self.split_blocks = blocks
        self.blocks_of_column = {}
        self.paired_by_blocks = []

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
        carried = []
        found = [
            self._groups(self.trace.children[parent], candidates, carried)
            for parent in sorted(self.trace.children, key=_start_order)
        ]
        unlike = self._paired_unlike(
            [group for groups, _ in found for group in groups]
        )
        for groups, whole in found:
            for columns, rows in groups:
                if any(id(c.layer) in unlike for c in columns + rows):
                    continue
                key = id(rows[0].layer)
                for call in columns:
                    blocks = self.blocks_of_column.get(call.index, 1)
                    decisions[id(call.layer)] = Decision(
                        call.layer, Column(blocks=blocks), key, _PAIRED, True
                    )
                    for layer in self.through.get(call.index, ()):
                        decisions[id(layer)] = Decision(
                            layer, Channelwise(), key, _PAIRED, True
                        )
                for row in rows:
                    decisions[id(row.layer)] = Decision(
                        row.layer, Row(), key, _PAIRED, True
                    )
            for call, key in whole:
                decisions[id(call.layer)] = Decision(
                    call.layer, Replicate(), id(call.layer), "auto: whole"
                )
                self.whole_inputs.setdefault(key, []).append(call.layer)
        self._apply_layout_map(decisions, leaves)
        if self.layout_map is not None:
            self._keep_unlisted_whole(decisions, leaves)
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
            if style is not None and not self._negligible(layer):
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
        try:
            check_shardable(
                layer, handler, ExpertParallel(), self.tensor_parallel
            )
        except ShardingError:
            # A guess from the weights' shapes (a depthwise kernel's
            # leading axis is no bank of experts): no reason to report.
            return None
        found, axis = expert_output_axis(
            calls[0], handler, self.tensor_parallel
        )
        if not found:
            return None
        self.reasons.pop(layer.path, None)
        return ExpertParallel(output_axis=axis)

    def _negligible(self, layer):
        """Whether `layer` stays whole rather than split alone, its
        weights under `NEGLIGIBLE_SHARE` of the model's; records why."""
        share = sum(map(nbytes, layer.weights)) / self.model_bytes
        if share >= NEGLIGIBLE_SHARE:
            return False
        self.reasons[layer.path] = (
            f"kept whole: {share:.2%} of the model's parameter bytes; split "
            "without a Megatron pair it would cost a collective at every call"
        )
        return True

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

    def whole_key_values(self, decisions):
        """`{layer: SummedCall}`: the whole key/value projections (fewer
        heads than ranks) that feed split query heads. Where ranks hold
        their own slices, each rank's gradient of their weights and inputs
        is a partial sum (see `partial_gradients`); their inputs are
        whole."""
        return {
            layer: SummedCall((), ())
            for key, layers in self.whole_inputs.items()
            if any(d.group == key and d.paired for d in decisions.values())
            for layer in layers
        }

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


def _start_order(parent):
    """Parent calls in the order their first child started (the model's
    own calls, `None`, first)."""
    return -1 if parent is None else parent
