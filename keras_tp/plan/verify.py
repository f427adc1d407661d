"""The local-execution check: every rank's view of a plan, on one device.

On torch and TensorFlow (and on JAX with a data axis) each rank runs the
model's code on its own tensors, and the raw ops between a Column layer
and its Row partner see that rank's slice: a reshape to a head count of
the config, or a weight read outside its layer's `call`, would break
silently. So the plan is checked numerically once, on its trace's batch:

- for each rank, the model runs on one device with every split layer
  replaced by what that rank computes: a Column layer its slice of the
  output, from its slice of the weights; a layer whose output is whole
  after its collective (Row, Vocab, a gathering Column) the one-device
  output of that call, so the ranks need not run together;
- a Row layer's input must be that rank's slice of its one-device input,
  every whole value (the inputs of split layers, each block's output, the
  model's output) must equal the one-device value, and a split variable
  must not be read outside its layer's call.

No collective runs: this is a check of the plan, not a way to train.
"""

import collections
import contextlib
import logging
import re

import keras
import numpy as np

from keras_tp.keras_internals import ReadWatcher
from keras_tp.keras_internals import holds_values
from keras_tp.keras_internals import own_seed_generators
from keras_tp.keras_internals import own_trainable_variables
from keras_tp.keras_internals import own_variables
from keras_tp.plan import trace as tracing
from keras_tp.plan.arguments import local_arguments
from keras_tp.plan.comparing import as_numpy
from keras_tp.plan.comparing import close_to
from keras_tp.plan.comparing import slice_tensor
from keras_tp.plan.head_counts import local_counts
from keras_tp.plan.head_counts import with_whole_heads
from keras_tp.plan.sharding_plan import ShardedUnit
from keras_tp.plan.sharding_plan import SummedCall
from keras_tp.plan.sharding_plan import split_axes
from keras_tp.plan.styles import Channelwise
from keras_tp.plan.styles import Column
from keras_tp.plan.styles import Row

logger = logging.getLogger(__name__)

Problem = collections.namedtuple(
    "Problem", ["reason", "whole", "crossing"], defaults=[False]
)
Problem.__doc__ = """Why a group (or a layer) fails the check; whether it
must stay whole (`whole=True`) or may still gather/slice; whether a call
that received its split value failed (`crossing`: code that needs the
value whole, where XLA, on global arrays, would gather it)."""


class _OneRank:
    """The collective adapter of one emulated rank: no collective runs.

    A Column layer's local call only needs its rank and `copy_to_parallel`
    (identity forward); the layers whose output needs a collective are not
    run but answered with their one-device output.
    """

    def __init__(self, rank):
        self._rank = rank

    def rank(self):
        return self._rank

    def copy_to_parallel(self, x):
        return x


def local_problems(
    model, plan, trace, group_of, random_inputs=None, units_only=False
):
    """Checks a bound plan for ranks that hold their own slices.

    Args:
        model: the model `plan` is bound to (not yet split).
        plan: a bound `ShardingPlan`.
        trace: the `Trace` of `model` on the probe batch (the one-device
            values).
        group_of: `{id(layer): group key}` for each split leaf layer;
            problems are reported per group.
        random_inputs: a dict that receives, for each layer drawing random
            numbers of its own (a Dropout), whether the input of each of
            its calls in one forward pass is split on a rank:
            `{layer: [bool, ...]}`, in the order of the calls.
        units_only: check only the attention units' own calls, for a
            runtime that runs the rest on whole values (JAX without a data
            axis): a unit still runs on each rank's heads, with its other
            arguments whole (a per-head bias its parent passes in).

    Returns:
        `{group key or layer path: Problem}`; empty when every rank's view
        gives the one-device numbers.
    """
    for rank in range(plan.tensor_parallel):
        emulation = _Emulation(model, plan, trace, group_of, rank)
        with _quiet_backend_fallbacks():
            problems = emulation.run_units() if units_only else emulation.run()
        if random_inputs is not None:
            random_inputs.clear()
            random_inputs.update(emulation.random_inputs)
        if problems:
            return problems
    return {}


@contextlib.contextmanager
def _quiet_backend_fallbacks():
    """Silences the tracebacks Keras' JAX backend logs (absl) where a view
    the check rejects fails in a fused kernel that Keras falls back from."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        absl.setLevel(level)


class _Emulation:
    def __init__(self, model, plan, trace, group_of, rank):
        self.model = model
        self.plan = plan
        self.trace = trace
        self.group_of = group_of
        self.rank = rank
        self.entries = {id(e.layer): e for e in plan.leaf_layers()}
        self.problems = {}
        self.active = []  # groups whose split values are alive
        self.split_values = {}  # {id(tensor): (tensor, its group)}
        self.counters = collections.Counter()
        self.random_inputs = {}

    def run_units(self):
        """Runs each attention unit's traced calls on this rank's heads."""
        self._slice_weights()
        for entry in self.plan.layers:
            if not isinstance(entry, ShardedUnit):
                continue
            unit = entry.layer
            member = next(iter(entry.projections.values()))
            for reference in self.trace.calls_of[id(unit)]:
                self.active = [self.group_of[id(member.layer)]]
                args, kwargs = tracing.copied(reference.argument_values)
                counts = self.plan.per_rank_counts.get(unit, {})
                args, kwargs = local_arguments(
                    unit, counts, self._head_slice, args, kwargs
                )
                try:
                    with (
                        tracing.instrumented(unit, self._wrap),
                        local_counts(unit, counts, self._head_slice),
                    ):
                        outputs = unit.call(*args, **kwargs)
                    self._compare(
                        tracing.flat_tensors(outputs),
                        reference.output_values,
                        f"the output of '{unit.path}'",
                    )
                except Exception as error:  # noqa: BLE001 - a finding
                    what = f"'{unit.path}' fails on a rank's heads"
                    self._blame_active(_broken(error, what))
        return self.problems

    def _slice_weights(self):
        """This rank's slice of every split layer's weights; returns
        `{id(variable): layer path}` of the split variables."""
        watched, self.local_weights = {}, {}
        for entry in self.entries.values():
            variables = entry.handler.variables(entry.layer)
            for variable in variables.values():
                watched[id(variable)] = entry.layer.path
            self.local_weights[id(entry.layer)] = {
                role: slice_tensor(
                    v,
                    self.plan.tensor_parallel,
                    entry.axes.get(role),
                    self.rank,
                    getattr(entry.style, "blocks", 1),
                )
                for role, v in variables.items()
            }
        return watched

    def run(self):
        watcher = ReadWatcher(self._slice_weights())
        specs = self._relax_row_specs()
        try:
            with tracing.instrumented(self.model, self._wrap), watcher:
                outputs = self.model(self.trace.inputs, training=False)
            if not self.problems:
                self._compare(
                    tracing.flat_tensors(outputs),
                    tracing.flat_tensors(self.trace.outputs),
                    "the model's output",
                )
        except Exception as error:  # noqa: BLE001 - any failure is a finding
            logger.debug("Rank %d's view failed", self.rank, exc_info=True)
            if not self.problems:
                self._blame_active(_broken(error))
        finally:
            for spec, axes in specs:
                spec.axes = axes
        for path in dict.fromkeys(watcher.read):
            self.problems[path] = Problem(
                "its weights are also read outside the layer's own call "
                "(tied weights), where a rank would see only its slice",
                True,
            )
        return self.problems

    def _relax_row_specs(self):
        """Layers that take their input split: drop the width check."""
        saved = []
        for entry in self.entries.values():
            spec = entry.layer.input_spec
            splits_input = isinstance(entry.style, Channelwise) or (
                isinstance(entry.style, Row) and entry.style.input_is_parallel
            )
            if splits_input and isinstance(spec, keras.InputSpec):
                saved.append((spec, spec.axes))
                spec.axes = {}
        return saved

    def _wrap(self, layer, call):
        entry = self.entries.get(id(layer))
        counts = self.plan.per_rank_counts.get(layer, {})

        def emulated(*args, **kwargs):
            index = self.counters[id(layer)]
            self.counters[id(layer)] += 1
            reference = self.trace.calls_of[id(layer)][index]
            if entry is None:
                args, kwargs = local_arguments(
                    layer, counts, self._head_slice, args, kwargs
                )
                local_call = with_whole_heads(
                    counts,
                    call,
                    lambda: (self.rank, self.plan.tensor_parallel),
                )
                with local_counts(layer, counts, self._head_slice):
                    return self._run_whole(
                        layer, local_call, reference, args, kwargs
                    )
            return self._run_split(entry, reference, args, kwargs)

        return emulated

    def _run_whole(self, layer, call, reference, args, kwargs):
        inputs = tracing.flat_tensors((args, kwargs))
        groups = [
            self.split_values[id(t)][1]
            for t in inputs
            if id(t) in self.split_values
        ]
        try:
            outputs = call(*args, **kwargs)
        except Exception as error:
            # The innermost failing call meets these groups' split values
            # (a residual add of a Column's output to a whole tensor, say).
            for group in dict.fromkeys(groups if not self.problems else []):
                self.problems[group] = Problem(_broken(error), False, True)
            raise
        local = [tuple(a.shape) for a in inputs] != [
            tuple(a.shape) for a in reference.inputs
        ]
        if local and groups:
            self._mark(outputs, groups[0])
        if own_seed_generators(layer):
            self.random_inputs.setdefault(layer, []).append(local)
        own = own_trainable_variables(layer)
        if local and own and self.active:
            self._sum_gradients(layer, inputs, outputs, reference)
        elif not local:
            self._compare(
                tracing.flat_tensors(outputs),
                reference.output_values,
                f"the output of '{layer.path or layer.name}'",
                may_split=True,
            )
        return outputs

    def _sum_gradients(self, layer, inputs, outputs, reference):
        """A layer with weights of its own on split activations (a norm of
        each head): the ranks sum its weights' partial gradients
        (`partial_gradients`); its output meets whole values later."""
        split = SummedCall(
            split_axes(inputs, reference.inputs),
            split_axes(tracing.flat_tensors(outputs), reference.output_values),
        )
        if len(own_variables(layer)) > len(own_trainable_variables(layer)):
            self._blame_active(
                f"layer '{layer.path}' runs on split activations with "
                "state of its own, which each rank would update from its "
                "part alone"
            )
        elif self.plan.summed_gradients.setdefault(layer, split) != split:
            self._blame_active(
                f"layer '{layer.path}' runs on split and on whole "
                "activations with weights of its own"
            )

    def _run_split(self, entry, reference, args, kwargs):
        layer, style = entry.layer, entry.style
        group = self.group_of[id(layer)]
        if isinstance(style, Channelwise):
            return self._run_channelwise(entry, reference, args, kwargs)
        inputs = tracing.flat_tensors((args, kwargs))
        what = f"the input of '{layer.path}'"
        splits_input = isinstance(style, Row) and style.input_is_parallel
        if splits_input:
            whole = as_numpy(reference.input_values[0])
            axis = entry.handler.input_axis(layer, style, whole.ndim)
            if inputs and tuple(inputs[0].shape) == whole.shape:
                width = whole.shape[axis]
                self.problems[group] = Problem(
                    f"Layer '{layer.path}' receives its whole input, but "
                    "Row() expects this rank's "
                    f"{width // self.plan.tensor_parallel} of {width} "
                    "features (the output of a Column layer); "
                    "use Row(input_is_parallel=False) for a whole input",
                    False,
                )
            expected = self._rank_slice(whole, axis)
            self._compare(inputs[:1], [expected], what, group)
            if group in self.active:
                self.active.remove(group)
        else:
            self._compare(inputs, reference.input_values, what, group)
        if isinstance(style, Column) and not style.gather_output:
            weights = self.local_weights[id(layer)]
            if group not in self.active:
                self.active.append(group)
            outputs = entry.handler.local_call(
                layer, style, _OneRank(self.rank), weights, args[0], **kwargs
            )
            return self._mark(outputs, group)
        return tracing.copied(reference.result_value)

    def _mark(self, outputs, group):
        for tensor in tracing.flat_tensors(outputs):
            self.split_values[id(tensor)] = (tensor, group)
        return outputs

    def _run_channelwise(self, entry, reference, args, kwargs):
        """A per-channel layer: its input must be this rank's channels."""
        layer = entry.layer
        local = as_numpy(args[0])
        whole = as_numpy(reference.input_values[0])
        split = [
            axis
            for axis in range(whole.ndim)
            if local.shape[axis] != whole.shape[axis]
        ]
        if len(split) != 1:
            self.problems[self.group_of[id(layer)]] = Problem(
                f"Layer '{layer.path}' receives an input of shape "
                f"{local.shape}, but Channelwise() expects this rank's "
                f"channels of its input {whole.shape} (the output of a "
                "Column layer)",
                False,
            )
            return tracing.copied(reference.result_value)
        self._compare(
            [local],
            [self._rank_slice(whole, split[0])],
            f"the input of '{layer.path}'",
            self.group_of[id(layer)],
        )
        made_by = self.split_values.get(id(args[0]))
        return self._mark(
            entry.handler.run_local(
                layer, self.local_weights[id(layer)], args, kwargs
            ),
            made_by[1] if made_by else self.group_of[id(layer)],
        )

    def _head_slice(self, weight, axis):
        return slice_tensor(weight, self.plan.tensor_parallel, axis, self.rank)

    def _rank_slice(self, value, axis):
        """This rank's slice of a NumPy `value` on `axis`."""
        return np.array_split(value, self.plan.tensor_parallel, axis)[self.rank]

    def _compare(self, actual, expected, what, group=None, may_split=False):
        """`may_split`: a value may be this rank's slice of the one-device
        value on one axis (a key/value cache returned on split heads)."""
        if self.problems:
            return
        for a, b in zip(actual, expected):
            if not (holds_values(a) and holds_values(b)):
                continue  # a control-flow op traced the call: no values
            a, b = as_numpy(a), as_numpy(b)
            if may_split and self._is_rank_slice(a, b):
                continue
            shapes = f"shape {a.shape} on a rank, expected {b.shape}"
            if a.shape != b.shape:
                reason = f"{what} has {shapes}"
            elif not close_to(a, b):
                reason = f"{what} differs from the one-device value"
            else:
                continue
            if group is None:
                self._blame_active(reason)
            else:
                self.problems[group] = Problem(reason, False)
            return

    def _is_rank_slice(self, a, b):
        if a.ndim != b.ndim:
            return False
        axes = [i for i in range(b.ndim) if a.shape[i] != b.shape[i]]
        if len(axes) != 1:
            return False
        part = self._rank_slice(b, axes[0])
        return part.shape == a.shape and close_to(a, part)

    def _blame_active(self, reason):
        if self.problems:
            return
        blamed = self.active or list(dict.fromkeys(self.group_of.values()))
        for group in blamed:
            self.problems[group] = Problem(reason, False)


def _broken(error, what="a rank's slice breaks the code between split layers"):
    """`what`, with the error's first line: past the one Keras adds naming
    the layer whose call raised it, without terminal colours."""
    lines = [
        re.sub(r"\x1b\[[0-9;]*m", "", line).strip()
        for line in str(error).splitlines()
        if line.strip() and "Exception encountered when calling" not in line
    ]
    first = lines[0][:200] if lines else ""
    return f"{what} ({type(error).__name__}: {first})"
