"""`ShardingPlan`: which layers are split, and how, as data."""

import collections
import copy
import re

import keras

from keras_tp.errors import ShardingError
from keras_tp.keras_internals import own_variables
from keras_tp.keras_internals import sublayers
from keras_tp.plan.attention import ATTENTION
from keras_tp.plan.handler import is_elementwise
from keras_tp.plan.head_counts import per_rank_counts
from keras_tp.plan.layers import leaf_handler
from keras_tp.plan.styles import Column
from keras_tp.plan.styles import Replicate
from keras_tp.plan.styles import ShardingStyle

MODEL_AXIS = "model"

ShardedLayer = collections.namedtuple(
    "ShardedLayer", ["layer", "handler", "style", "axes"]
)
ShardedLayer.__doc__ = """One split leaf layer: its handler, style and the
axis each of its variables (by role) is split on (`None`: replicated)."""

ShardedUnit = collections.namedtuple("ShardedUnit", ["layer", "projections"])
ShardedUnit.__doc__ = """An attention layer run as one region; `projections`
maps the sublayer attribute to its `ShardedLayer`."""

SummedCall = collections.namedtuple("SummedCall", ["input_axes", "output_axes"])
SummedCall.__doc__ = """How a whole layer is called on split activations
(`partial_gradients`): for each tensor input and each tensor output, in
order, the axis a rank holds its slice of (`None`: whole)."""


def split_axes(local_values, whole_values):
    """The axis each of `local_values` is a rank's slice of its whole
    value on (`None` where the shapes agree)."""
    axes = []
    for local, whole in zip(local_values, whole_values):
        pairs = enumerate(zip(local.shape, whole.shape))
        axes.append(next((axis for axis, (a, b) in pairs if a != b), None))
    return tuple(axes)


class ShardingPlan:
    """An ordered mapping from variable-path regex to sharding style.

    Keys are matched against the path of each supported layer's main
    variable (`kernel`, or `embeddings`): an exact match wins, otherwise
    exactly one key may match with `re.search`. Unlike
    `keras.distribution.LayoutMap`, which needs `re.fullmatch`, a key may
    name part of a path, as torchtitan's plans name modules: `"mlp_up"`
    matches `"block_0/mlp_up/kernel"`; anchor a key with `^` and `$` to
    match whole paths only. Layers no key matches stay replicated.

    A plan returned by `auto_plan` or `TensorParallelKeras.sharding_plan` is
    also *bound* to its model: it knows the split axis of every variable and
    why each remaining layer stays replicated, which `summary()` and
    `to_layout_map()` use.

    Args:
        rules: a dict `{regex: style}` or an iterable of `(regex, style)`.

    Example:

    ```python
    plan = keras_tp.ShardingPlan({
        "embed/embeddings": keras_tp.Vocab(),
        r"block_\\d+/attention/(query|key|value)/kernel": keras_tp.Column(),
        r"block_\\d+/attention/attention_output/kernel": keras_tp.Row(),
        r"block_\\d+/mlp_up/kernel": keras_tp.Column(),
        r"block_\\d+/mlp_down/kernel": keras_tp.Row(),
    })
    tp = keras_tp.TensorParallelKeras(model, tensor_parallel=2, plan=plan)
    ```
    """

    def __init__(self, rules=None):
        items = rules.items() if isinstance(rules, dict) else (rules or ())
        self.rules = []
        for pattern, style in items:
            if not isinstance(style, ShardingStyle):
                raise TypeError(
                    f"The style for {pattern!r} must be a keras_tp style "
                    "(Column(), Row(), Vocab(), Channelwise(), "
                    f"ExpertParallel() or Replicate()), got {style!r}."
                )
            re.compile(pattern)
            self.rules.append((pattern, style))
        self.tensor_parallel = None
        self.layers = []
        self.replicated = {}
        # What decided each split layer (`"user plan"`, `"model layout
        # map"`, `"auto: ..."`), and why auto fell back where it did.
        self.sources = {}
        self.fallbacks = {}
        # The layers drawing random numbers on split activations (a
        # Dropout between a Column layer and its Row partner), found by
        # the local-execution check: each rank draws its own there.
        # `{layer: (split, ...)}`, per call in a forward pass.
        self.per_rank_random = {}
        # The head counts layers read from their config, per rank
        # (`head_counts.per_rank_counts`): `{layer: {attribute: count}}`.
        self.per_rank_counts = {}
        # Whole layers computing on split activations, whose gradients the
        # ranks sum (`partial_gradients`): `{layer: SummedCall}`.
        self.summed_gradients = {}
        # Paths of the whole layers whose partial gradients XLA would sum
        # on global arrays, in collectives of its own (`on_global_arrays`):
        # a runtime that can run its steps per rank does so instead.
        self.summed_by_xla = []
        # Paths of the Row layers whose Columns would pair by blocks
        # (`Column(blocks=b)`) where the runtime stored such splits: a
        # runtime that can, by running its steps per rank, does so.
        self.paired_by_blocks = []

    def __repr__(self):
        lines = [
            f"    {pattern!r}: {style!r}," for pattern, style in self.rules
        ]
        return "ShardingPlan({\n" + "\n".join(lines) + "\n})"

    def __len__(self):
        return len(self.rules)

    def items(self):
        return list(self.rules)

    def match(self, path):
        """Returns `(pattern, style)` for `path`, or `None`."""
        for pattern, style in self.rules:
            if pattern == path:
                return pattern, style
        hits = [(p, s) for p, s in self.rules if re.search(p, path)]
        if len(hits) > 1:
            raise ValueError(
                f"Variable path '{path}' matches several plan keys: "
                f"{[p for p, _ in hits]}. Make the keys more specific "
                "(anchor them with ^ and $) so each path matches one."
            )
        return hits[0] if hits else None

    def bind(self, model, tensor_parallel):
        """Resolves the rules against `model`'s layers for `tensor_parallel`.

        Returns a new, bound `ShardingPlan`. Raises a `ShardingError` that
        names the variable and the fix when a rule cannot be applied exactly.
        """
        bound = ShardingPlan(self.rules)
        bound.tensor_parallel = tensor_parallel
        used = set()
        for layer in supported_layers(model):
            if ATTENTION.matches(layer):
                entry = _bind_attention(self, layer, tensor_parallel, used)
            else:
                entry = _bind_leaf(self, layer, tensor_parallel, used)
            if entry is not None:
                bound.layers.append(entry)
        unused = [p for p, _ in self.rules if p not in used]
        if unused:
            raise ValueError(
                f"Plan keys {unused} match no variable of a supported layer "
                f"in model '{model.name}'. Check the paths with "
                "`[v.path for v in model.weights]`."
            )
        bound.replicated = replicated_layers(model, bound)
        bound.per_rank_counts = per_rank_counts(model, bound)
        return bound

    def source_of(self, entry):
        """What decided the split of a `ShardedLayer` (or its unit)."""
        for path, source in self.sources.items():
            if entry.layer.path == path or entry.layer.path.startswith(
                path + "/"
            ):
                return source
        return ""

    def split_variables(self):
        """`[(variable, axis), ...]`: every split variable and its axis.

        Two variables can share a path (two sub-models whose layers have
        the same names, as CLIP's vision and text encoders do), so code
        that places variables goes by this list, not by path.
        """
        split = []
        for entry in self.leaf_layers():
            variables = entry.handler.variables(entry.layer)
            for role, axis in entry.axes.items():
                if axis is not None and role in variables:
                    split.append((variables[role], axis))
        return split

    def variable_blocks(self):
        """`{id(variable): blocks}` of the split variables of the
        `Column(blocks=b)` layers (`b > 1`): each rank holds its part of
        each block (`keras_tp.blocks`)."""
        blocked = {}
        for entry in self.leaf_layers():
            blocks = getattr(entry.style, "blocks", 1)
            if blocks == 1:
                continue
            variables = entry.handler.variables(entry.layer)
            for role, axis in entry.axes.items():
                if axis is not None and role in variables:
                    blocked[id(variables[role])] = blocks
        return blocked

    def variable_axes(self):
        """`{variable_path: (variable, axis)}` of every split variable
        (one of the variables where several share a path; see
        `split_variables`)."""
        return {v.path: (v, axis) for v, axis in self.split_variables()}

    def part_for(self, keep):
        """A copy of this bound plan with only the layers `keep(layer)`
        accepts: their entries, and what it says of each of them."""
        part = copy.copy(self)
        part.layers = [entry for entry in self.layers if keep(entry.layer)]
        for name in ("per_rank_random", "per_rank_counts", "summed_gradients"):
            layers = getattr(self, name)
            setattr(part, name, {k: v for k, v in layers.items() if keep(k)})
        return part

    def leaf_layers(self):
        """Every `ShardedLayer`, the projections of units included."""
        for entry in self.layers:
            if isinstance(entry, ShardedUnit):
                yield from entry.projections.values()
            else:
                yield entry

    def unit_members(self):
        """The ids of the layers inside the plan's attention units, whose
        regions run them on a rank's heads."""
        return {
            id(sub)
            for entry in self.layers
            if isinstance(entry, ShardedUnit)
            for sub in sublayers(entry.layer)
        }

    def to_layout_map(self, device_mesh):
        """Exports the same sharding as a `keras.distribution.LayoutMap`.

        Each split variable maps to a layout naming `"model"` on its split
        axis; everything else is replicated. The map can be given to
        `keras.distribution.ModelParallel` to compare with Keras' own
        (GSPMD) model parallelism on JAX.

        Args:
            device_mesh: a `keras.distribution.DeviceMesh` with a `"model"`
                axis whose size equals the plan's world size.

        Returns:
            A `keras.distribution.LayoutMap`.
        """
        if self.tensor_parallel is None:
            raise ValueError(
                "to_layout_map() needs a plan bound to a model: use "
                "`keras_tp.auto_plan(model, tensor_parallel)`, "
                "`tp.sharding_plan`, or `plan.bind(model, tensor_parallel)`."
            )
        if MODEL_AXIS not in device_mesh.axis_names:
            raise ValueError(
                f"The device mesh needs a '{MODEL_AXIS}' axis; it has "
                f"{device_mesh.axis_names}."
            )
        size = device_mesh.shape[device_mesh.axis_names.index(MODEL_AXIS)]
        if size != self.tensor_parallel:
            raise ValueError(
                f"The mesh's '{MODEL_AXIS}' axis has {size} devices but the "
                f"plan was made for {self.tensor_parallel}."
            )
        layout_map = keras.distribution.LayoutMap(device_mesh)
        for path, (variable, axis) in self.variable_axes().items():
            axes = [None] * len(variable.shape)
            axes[axis] = MODEL_AXIS
            layout_map["^" + re.escape(path) + "$"] = tuple(axes)
        return layout_map


def walk_layers(layer):
    """Yields every sublayer of `layer`, depth first, each once."""
    seen = set()
    stack = list(reversed(sublayers(layer, recursive=False)))
    while stack:
        sub = stack.pop()
        if id(sub) in seen:
            continue
        seen.add(id(sub))
        yield sub
        stack.extend(reversed(sublayers(sub, recursive=False)))


def supported_layers(model):
    """Attention units and supported leaf layers, outside any unit, that
    are built: a layer the model never calls (SAM's mask decoder, in its
    backbone) has no weights to split."""
    inside_units = set()
    layers = []
    for layer in walk_layers(model):
        if id(layer) in inside_units or not layer.built:
            continue
        if ATTENTION.matches(layer):
            inside_units.update(id(sub) for sub in walk_layers(layer))
            layers.append(layer)
        elif leaf_handler(layer) is not None:
            layers.append(layer)
    return layers


def _style_for(plan, variable, used):
    hit = plan.match(variable.path)
    if hit is None:
        return None
    used.add(hit[0])
    return None if isinstance(hit[1], Replicate) else hit[1]


def check_shardable(layer, handler, style, tensor_parallel):
    """Raises a `ShardingError` if `style` cannot split `layer` exactly."""
    primary = handler.primary_variable(layer)
    if not isinstance(style, handler.styles):
        allowed = ", ".join(s.__name__ + "()" for s in handler.styles)
        raise ShardingError(
            f"Variable '{primary.path}': {style!r} does not apply to "
            f"{type(layer).__name__} layers. Use {allowed} or Replicate()."
        )
    reason = handler.unsupported_reason(layer)
    if reason:
        raise ShardingError(
            f"Variable '{primary.path}' cannot be split: layer "
            f"'{layer.path}' is {reason}. Map it to Replicate()."
        )
    activation = getattr(layer, "activation", None)
    if (
        isinstance(style, Column)
        and not style.gather_output
        and not is_elementwise(activation)
    ):
        raise ShardingError(
            f"Variable '{primary.path}': {style!r} leaves the output split, "
            "but the activation "
            f"{getattr(activation, '__name__', activation)!r} "
            f"of layer '{layer.path}' mixes features. Use "
            "Column(gather_output=True) or Replicate()."
        )
    size = handler.split_size(layer, style)
    if size % tensor_parallel:
        axis = handler.split_axes(layer, style)[handler.primary_role(layer)]
        raise ShardingError(
            f"Variable '{primary.path}' of shape {tuple(primary.shape)} "
            f"cannot be split {tensor_parallel} ways with {style!r}: axis "
            f"{axis} has size {size}, not divisible by {tensor_parallel}. "
            f"Use a tensor-parallel size that divides {size}, or map it to "
            "Replicate()."
        )


def _bind_leaf(plan, layer, tensor_parallel, used):
    handler = leaf_handler(layer)
    style = _style_for(plan, handler.primary_variable(layer), used)
    if style is None:
        return None
    check_shardable(layer, handler, style, tensor_parallel)
    return ShardedLayer(layer, handler, style, handler.split_axes(layer, style))


def _bind_attention(plan, layer, tensor_parallel, used):
    projections = ATTENTION.projections(layer)
    styles = {}
    for name, sub in projections.items():
        handler = leaf_handler(sub)
        styles[name] = _style_for(plan, handler.primary_variable(sub), used)
    if all(style is None for style in styles.values()):
        return None
    expected = {name: ATTENTION.projection_style(name) for name in projections}
    if styles != expected:
        listing = ", ".join(f"{n.strip('_')}={s!r}" for n, s in styles.items())
        raise ShardingError(
            f"Attention layer '{layer.path}' is split partially ({listing}). "
            "Its query/key/value projections must all be Column() and its "
            "output projection Row(), or all Replicate()."
        )
    query_heads, kv_heads = ATTENTION.heads(layer)
    if query_heads % tensor_parallel or kv_heads % tensor_parallel:
        raise ShardingError(
            f"Attention layer '{layer.path}' has {query_heads} query heads "
            f"and {kv_heads} key/value heads; both must be divisible by "
            f"tensor_parallel={tensor_parallel} to split it by heads. Map "
            "its projections to Replicate(), or use a tensor-parallel size "
            f"dividing {kv_heads}."
        )
    entries = {}
    for name, sub in projections.items():
        handler = leaf_handler(sub)
        check_shardable(sub, handler, styles[name], tensor_parallel)
        entries[name] = ShardedLayer(
            sub, handler, styles[name], handler.split_axes(sub, styles[name])
        )
    return ShardedUnit(layer, entries)


def replicated_layers(model, bound):
    """`{layer_path: reason}` for layers with weights that are not split.

    An attention layer is listed once, not with each of its projections.
    """
    covered = set()
    for entry in bound.layers:
        covered.add(id(entry.layer))
        if isinstance(entry, ShardedUnit):
            covered.update(id(sub) for sub in walk_layers(entry.layer))
    reasons = {}
    for layer in walk_layers(model):
        # A layer never built has no path (SmolLM3's rotary embedding,
        # whose frequencies its attention reads): its name stands in.
        path = layer.path or layer.name
        if id(layer) in covered:
            continue
        if ATTENTION.matches(layer):
            covered.update(id(sub) for sub in walk_layers(layer))
            reasons[path] = "not in the plan"
        elif not own_variables(layer):
            continue
        elif leaf_handler(layer) is None:
            reasons[path] = (
                f"{type(layer).__name__}: not a layer keras_tp splits"
            )
        else:
            reasons[path] = "not in the plan"
    return reasons
