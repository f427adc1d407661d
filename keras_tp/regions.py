"""Sharded regions: the layers whose call runs per rank on local weights.

A region is a split leaf layer, or an attention layer with its projections.
Installing a plan replaces its `call` with one that hands the work to the
backend runtime (which makes the local tensors: a `shard_map` on JAX, the
process on torch). Inside, the handlers read their local weights from a
context the runtime sets: the per-rank math never touches the backend.
"""

import contextlib
import contextvars

import keras

from keras_tp.keras_internals import get_keras_mask
from keras_tp.keras_internals import seed_generators
from keras_tp.keras_internals import set_keras_mask
from keras_tp.plan.arguments import head_arguments
from keras_tp.plan.attention import ATTENTION
from keras_tp.plan.attention import call_argument
from keras_tp.plan.attention import call_arguments
from keras_tp.plan.attention import input_first
from keras_tp.plan.attention import split_cache
from keras_tp.plan.head_counts import call_with_local_counts
from keras_tp.plan.sharding_plan import ShardedUnit
from keras_tp.plan.split_logits import logits_stay_split
from keras_tp.plan.styles import Column
from keras_tp.plan.styles import Row
from keras_tp.rank_draws import FORWARD_CALLS
from keras_tp.rank_draws import per_rank_draws
from keras_tp.rank_draws import split_random_call

_LOCAL_WEIGHTS = contextvars.ContextVar("keras_tp_local_weights", default=None)
_SHARED_COPIES = contextvars.ContextVar("keras_tp_shared_copies", default=None)


class ShardedRegion:
    """One layer whose call runs on every rank with local weights.

    Args:
        layer: the Keras layer whose `call` is replaced.
        members: the `ShardedLayer`s whose weights the region splits.
        compute: the per-rank function, called with the layer's arguments.
        output_axes: function of `(args, kwargs)` giving, for each output,
            the axis it leaves split on (`None`: replicated).
        full_shape: function giving a variable's unsplit shape.
        head_arguments: `{argument name: HeadArgument}` of the arguments
            that carry a value for every head, which the region takes
            split on their heads axis (XLNet's per-head attention biases,
            weights of the layer's caller).
    """

    def __init__(
        self, layer, members, compute, output_axes, full_shape, head_arguments
    ):
        self.layer = layer
        self.members = members
        self.compute = compute
        self.output_axes = output_axes
        self.full_shape = full_shape
        self.head_arguments = head_arguments

    def variables(self):
        """`[(variable, axis)]` of every member weight (axis may be None)."""
        pairs = []
        for member in self.members:
            variables = member.handler.variables(member.layer)
            for role, variable in variables.items():
                pairs.append((variable, member.axes.get(role)))
        return pairs

    @property
    def parallel_input(self):
        """Whether replicated inputs must pass `copy_to_parallel`."""
        return any(m.handler.parallel_input(m.style) for m in self.members)

    def main_input(self, args, kwargs):
        """The layer's first call argument, passed by position or by name
        (keras-hub's attention layers take `hidden_states=`)."""
        if args:
            return args[0]
        names = call_arguments(self.layer)
        return call_argument(self.layer, names[0], args, kwargs)

    def cache_axis(self, args, kwargs):
        """`(cache, axis)`: the key/value cache an attention layer takes in
        generation, and the axis its heads are split on (`None`: whole);
        `(None, None)` without a cache."""
        return split_cache(
            self.layer, self.members, args, kwargs, self.full_shape
        )

    def split_inputs(self, args, kwargs):
        """`{id(tensor): axis}` of the inputs that arrive split: the first
        input of a Row layer, the key/value cache of split heads, the
        arguments of every head (`head_arguments`)."""
        split = {}
        axis = self.input_axis(args)
        if axis is not None:
            split[id(args[0])] = axis
        cache, axis = self.cache_axis(args, kwargs)
        if axis is not None:
            split[id(cache)] = axis
        for name, axis in self.head_arguments.items():
            value = call_argument(self.layer, name, args, kwargs)
            if value is not None:
                split[id(value)] = int(axis)
        return split

    def input_axis(self, args):
        """Axis on which the first positional input arrives split."""
        if len(self.members) != 1 or not args:
            return None
        member = self.members[0]
        return member.handler.input_axis(
            member.layer, member.style, len(args[0].shape)
        )

    def accept_split_input(self):
        """Lets the region's Row layers take their input split.

        Keras checks a layer's input against the `input_spec` it was built
        with, whose feature width is the full one; when the region runs on
        a rank's local tensors a Row layer receives this rank's slice, so
        that width check is dropped (the rank check stays).
        """
        for member in self.members:
            if isinstance(member.style, Row) and member.style.input_is_parallel:
                _accept_split_input(member.layer)

    def drop_input_widths(self):
        """Drops the feature widths of the region's layers' input specs.

        For a runtime whose ranks hold local tensors, where a Row layer
        receives a Column layer's local output; `check_input_widths` then
        checks the widths split-aware.

        Returns:
            `{axis: width}` the region layer's spec required.
        """
        widths = {}
        for layer in [self.layer] + [m.layer for m in self.members]:
            spec = layer.input_spec
            if isinstance(spec, keras.InputSpec) and spec.axes:
                if layer is self.layer:
                    widths = dict(spec.axes)
                spec.axes = {}
        return widths

    def check_input_widths(self, widths, args, tensor_parallel):
        """Checks a rank's input against the widths `drop_input_widths` kept.

        Args:
            widths: `{axis: full width}`.
            args: the region's positional call arguments, local to a rank.
            tensor_parallel: the number of model ranks.
        """
        if not widths or not args:
            return
        shape = tuple(args[0].shape)
        split_axis = self.input_axis(args)
        path = self.layer.path
        for axis, size in widths.items():
            axis %= len(shape)
            if axis == split_axis:
                local = size // tensor_parallel
                if shape[axis] != local:
                    raise ValueError(
                        f"Layer '{path}' is split "
                        f"{self.members[0].style!r}: its input must arrive "
                        f"split on axis {axis}, {local} of {size} features per "
                        f"rank, but it has shape {shape}. A Row layer with "
                        "input_is_parallel=True must consume a Column "
                        "layer's output; use Row(input_is_parallel=False) for "
                        "a replicated input."
                    )
            elif shape[axis] != size:
                raise ValueError(
                    f"Layer '{path}' expects {size} features on axis "
                    f"{axis} of its input, got shape {shape}."
                )

    @contextlib.contextmanager
    def local_weights(self, values):
        """Binds each member variable to its local value inside the block."""
        mapping = {
            id(variable): value
            for (variable, _), value in zip(self.variables(), values)
        }
        token = _LOCAL_WEIGHTS.set(mapping)
        try:
            yield
        finally:
            _LOCAL_WEIGHTS.reset(token)


def copy_replicated_inputs(region, enter, args, kwargs, is_float):
    """Passes each distinct float input once through `enter`.

    For a region that runs on a rank's local tensors: its replicated inputs
    enter the parallel part (Megatron `f`, the adapter's
    `copy_to_parallel`), so their gradients are summed over the ranks. An
    input that arrives split is already parallel. Keras masks follow their
    tensors.

    Args:
        region: the `ShardedRegion`.
        enter: the function a replicated input enters through.
        args, kwargs: the region's call arguments.
        is_float: the test for a floating-point tensor.

    Returns:
        `(args, kwargs)` with the copies in place of the inputs.
    """
    split = region.split_inputs(args, kwargs)
    local = {}

    def copy(x):
        if id(x) in split or not is_float(x):
            return x
        return shared_value(x, enter, local)

    return keras.tree.map_structure(copy, (args, kwargs))


def shared_value(x, make, fallback=None):
    """`make(x)`, made once per tensor inside `forward_pass()`.

    Outside it, `fallback` (a dict) is the cache, or nothing is cached.
    Keras masks follow their tensors.
    """
    copies = _SHARED_COPIES.get()
    if copies is None:
        copies = {} if fallback is None else fallback
    if id(x) not in copies:
        out = make(x)
        mask = get_keras_mask(x)
        if mask is not None:
            set_keras_mask(out, mask)
        # The input is kept with its copy so that its id stays unique.
        copies[id(x)] = (x, out)
    return copies[id(x)][1]


def _local_weights_of(member):
    mapping = _LOCAL_WEIGHTS.get()
    if mapping is None:
        raise RuntimeError(
            f"Layer '{member.layer.path}' is split by keras_tp and can only "
            "run inside its sharded region (through the TensorParallelKeras "
            "model that owns it)."
        )
    variables = member.handler.variables(member.layer)
    return {role: mapping[id(v)] for role, v in variables.items()}


def _member_call(member, runtime):
    # The adapter is read at each call: a layer several pipeline stages
    # call runs on the calling stage's (`CallingStageRegions`).
    def local_call(inputs, *args, **kwargs):
        weights = _local_weights_of(member)
        return member.handler.local_call(
            member.layer,
            member.style,
            runtime.adapter,
            weights,
            inputs,
            **kwargs,
        )

    return local_call


def _leaf_output_axes(member):
    def output_axes(args, kwargs):
        style = member.style
        if logits_stay_split(member.layer) and (
            isinstance(style, Column) or kwargs.get("reverse")
        ):
            # An LM head's logits, split by vocabulary (`vocab_parallel`).
            return len(args[0].shape) - 1
        if not isinstance(style, Column) or style.gather_output:
            return None
        shape = member.layer.compute_output_shape(tuple(args[0].shape))
        return member.handler.output_axis(
            member.layer, member.style, len(shape)
        )

    return output_axes


def _unit_output_axes(unit, members, full_shape):
    def output_axes(args, kwargs):
        cache, axis = split_cache(unit, members, args, kwargs, full_shape)
        return ATTENTION.output_axes(unit, kwargs, cache, axis)

    return output_axes


def install(plan, runtime):
    """Replaces the `call` of every region layer of a bound `plan`.

    Returns the list of installed `ShardedRegion`s.
    """
    regions = []
    for entry in plan.layers:
        if isinstance(entry, ShardedUnit):
            members = list(entry.projections.values())
            for member in members:
                set_call(member.layer, _member_call(member, runtime))
            unit = entry.layer
            region = ShardedRegion(
                unit,
                members,
                per_rank_draws(seed_generators(unit), unit.call, runtime),
                _unit_output_axes(unit, members, runtime.full_shape),
                runtime.full_shape,
                head_arguments(plan.per_rank_counts.get(unit, {})),
            )
        elif not entry.handler.needs_region(entry.style):
            # It runs on each rank's values, which arrive split.
            _accept_split_input(entry.layer)
            runtime.prepare_local_layer(entry.layer)
            call = entry.handler.call_on_local_values(entry.layer, runtime)
            if call is not None:
                set_call(entry.layer, call)
            continue
        else:
            region = ShardedRegion(
                entry.layer,
                [entry],
                _member_call(entry, runtime),
                _leaf_output_axes(entry),
                runtime.full_shape,
                {},
            )
        set_call(region.layer, _region_call(region, runtime))
        for member in region.members:
            _refuse_late_lora(member.layer)
        runtime.prepare_region(region)
        regions.append(region)
    for layer, split_calls in plan.per_rank_random.items():
        set_call(layer, split_random_call(layer, split_calls, runtime))
    for layer, counts in plan.per_rank_counts.items():
        set_call(layer, call_with_local_counts(layer, counts, runtime))
    return regions


@contextlib.contextmanager
def forward_pass():
    """Inside, one forward pass of the model on one rank.

    - A replicated tensor enters the parallel part once: the query, key
      and value projections of an attention layer (or the gate and up
      projections of an MLP) read the same tensor; sharing its
      `copy_to_parallel` sums their input gradients on each rank first, so
      the backward pass all-reduces once per block, as Megatron's fused
      projection does, not once per projection.
    - The layers' calls are counted: a layer called on split and on whole
      activations in one pass (see `split_random_call`) tells its calls
      apart by their order.

    A runtime enters it on every rank (a thread of its own on TensorFlow,
    where context variables do not follow into replicas).
    """
    copies, calls = _SHARED_COPIES.set({}), FORWARD_CALLS.set({})
    try:
        yield
    finally:
        FORWARD_CALLS.reset(calls)
        _SHARED_COPIES.reset(copies)


def _accept_split_input(layer):
    """Drops the feature-width check of `layer`'s input spec (see above)."""
    specs = layer.input_spec
    for spec in specs if isinstance(specs, (list, tuple)) else [specs]:
        if isinstance(spec, keras.InputSpec):
            spec.axes = {}


def _refuse_late_lora(layer):
    """A split layer's LoRA must exist when the plan splits its kernel."""

    def enable_lora(*args, **kwargs):
        raise ValueError(
            f"Layer '{layer.path}' is split by keras_tp, so LoRA can no "
            "longer be added to it. Enable LoRA before wrapping: call "
            "`enable_lora(rank)` on the model (or its backbone), then "
            "`TensorParallelKeras(model, ...)`."
        )

    object.__setattr__(layer, "enable_lora", enable_lora)


def _region_call(region, runtime):
    def sharded_call(*args, **kwargs):
        return runtime.run_region(region, args, kwargs)

    return sharded_call


def set_call(layer, call):
    """Replaces `layer`'s call with `call`, which receives the layer's
    first call argument by position (`input_first`)."""
    # Bypass Keras' attribute tracking: `call` is a method, not state.
    object.__setattr__(layer, "call", input_first(layer, call))
