"""Where ranks hold their own slices: the plan's check, and what it finds.

`verify.local_problems` runs every rank's view of a plan on one device.
This module runs it for a plan given by the user (`check_locally`), and
turns what it finds into what the runtime needs: the layers that draw
random numbers per rank, the head counts each rank reads, and the whole
layers whose gradients the ranks sum.
"""

import itertools

from keras_tp.errors import ShardingError
from keras_tp.plan import trace as tracing
from keras_tp.plan.arguments import FeatureArgument
from keras_tp.plan.feature_arguments import add_feature_arguments
from keras_tp.plan.head_counts import add_head_arguments
from keras_tp.plan.head_counts import per_rank_counts
from keras_tp.plan.planner import Planner
from keras_tp.plan.rank_widths import add_rank_widths
from keras_tp.plan.sharding_plan import SummedCall
from keras_tp.plan.styles import Row
from keras_tp.plan.verify import local_problems


def check_locally(model, plan, sample_batch=None):
    """Raises a `ShardingError` if a rank holding its slices would be wrong.

    For a plan given by the user: the same check `auto_plan` runs, with
    each failing layer named.

    Args:
        model: the model `plan` is bound to (not yet split).
        plan: a bound `ShardingPlan`.
        sample_batch: the inputs to trace `model` on; default: a probe
            batch (see `keras_tp.auto_plan`).
    """
    group_of = {id(e.layer): e.layer.path for e in plan.leaf_layers()}
    random_inputs = {}
    trace = tracing.trace_model(model, sample_batch)
    add_head_arguments(model, plan, trace)
    add_feature_arguments(model, plan, trace)
    add_rank_widths(model, plan, trace)
    plan.summed_gradients = _whole_key_values(model, plan, trace)
    problems = counted_problems(model, plan, trace, group_of, random_inputs)
    if problems:
        listing = "; ".join(
            f"'{path}': {problem.reason}" for path, problem in problems.items()
        )
        raise ShardingError(
            f"The plan cannot run with each rank holding its own slices: "
            f"{listing}. Map these layers to Replicate(), or let "
            'plan="auto" choose.'
        )
    plan.per_rank_random = random_on_split_values(plan, random_inputs)
    keep_needed_counts(model, plan, trace, group_of)


def on_global_arrays(model, plan, trace, group_of, whole_key_values):
    """What each rank's view of a plan for global arrays finds.

    Where the code between split layers runs on global arrays (JAX
    without a data axis), any plan computes one device's numbers, but XLA
    moves whatever a rank's slices lack in collectives of its own, which
    no count sees:

    - a layer that receives a split value and needs it whole (a
      residual add of a Column's output, DepthAnything's neck) makes XLA
      gather it: such a group is a problem here too, and falls back as
      where ranks hold their own slices (a gathering Column, whose
      all-gather is counted). The other problems stay on global arrays,
      whose plan keeps its splits: weights read outside their layer (tied
      weights; XLA gathers them, each device keeps its slice) and whole
      values the layer's own code computes for split heads (Bloom's ALiBi
      slopes, which XLA slices where each device needs them);
    - a whole layer with weights of its own that reads split activations
      (Qwen3's norm of each head, HGNetV2's learnable scale of split
      channels) gets each device's partial gradient, which XLA would sum:
      run on each device's part (`partial_gradients`), it sums them in
      counted collectives. Kept out: layers inside an attention unit (its
      region runs them per device already), layers that read per-rank
      head counts, and every layer while a rank's view fails (a path only
      global arrays run right);
    - the other whole layers that get partial gradients stay on global
      arrays, where XLA sums them: a key/value projection with fewer
      heads than ranks reads whole inputs and feeds every device's heads,
      so XLA all-reduces its outputs' gradients (Gemma's single head).
      They are returned apart: steps that run per rank sum their weights'
      gradients instead, in counted collectives, as Megatron does.

    Returns:
        `(problems, summed, summed_by_xla)`: `{group: Problem}` of the
        groups to fall back, `{layer: SummedCall}`, and the paths of the
        layers whose gradients XLA would sum.
    """
    # The check may try other per-rank head counts: a copy of the plan
    # takes them, the one for global arrays keeps its own.
    ranks_view = plan.part_for(lambda layer: True)
    ranks_view.summed_gradients = dict(whole_key_values)
    problems = counted_problems(model, ranks_view, trace, group_of)
    if problems:
        return {k: p for k, p in problems.items() if p.crossing}, {}, []
    inside = plan.unit_members()
    outside = {
        layer: call
        for layer, call in ranks_view.summed_gradients.items()
        if id(layer) not in inside and layer not in ranks_view.per_rank_counts
    }
    summed = {
        layer: call
        for layer, call in outside.items()
        if any(axis is not None for axis in call.input_axes)
        and len(set(call.output_axes)) == 1
        and None not in call.output_axes
    }
    by_xla = [layer.path for layer in outside if layer not in summed]
    return {}, summed, by_xla


def random_on_split_values(plan, random_inputs):
    """The layers whose random draws act on split activations.

    A Dropout between a Column layer and its Row partner sees one rank's
    features; each rank must draw its own mask there, where a Dropout on a
    whole activation must draw the same mask on every rank. One layer may
    be called on both (keras-hub's ViT MLP applies one Dropout after each
    of its two Dense layers), so what is recorded is, per call in a
    forward pass, whether its input is split. The layers inside a split
    attention layer are left out: the whole region draws per rank.

    Args:
        plan: the bound plan that was checked.
        random_inputs: what `local_problems` recorded.

    Returns:
        `{layer: (split, ...)}`: for each layer that draws on split
        activations, whether each of its calls in a forward pass does.
    """
    inside = plan.unit_members()
    return {
        layer: tuple(calls)
        for layer, calls in random_inputs.items()
        if id(layer) not in inside and any(calls)
    }


def _whole_key_values(model, plan, trace):
    """`{layer: SummedCall}`: the layers a plan keeps whole that feed,
    through raw ops, the split heads of a Row it splits: key/value
    projections with fewer heads than ranks, found by `auto_plan`'s
    pairing walk. Their forward values are right on every rank, but each
    rank's gradient is a partial sum (see `Planner.whole_key_values`)."""
    planner = Planner(model, plan.tensor_parallel, trace)
    planner.decide()
    split = {id(entry.layer): entry.style for entry in plan.leaf_layers()}
    return {
        layer: SummedCall((), ())
        for key, layers in planner.whole_inputs.items()
        if isinstance(split.get(key), Row)
        for layer in layers
        if id(layer) not in split
    }


def counted_problems(
    model, plan, trace, group_of, random_inputs=None, units_only=False
):
    """`verify.local_problems`, where an attribute's per-rank count may be
    the problem.

    An attribute can equal a heads count and still need its whole value:
    T5Gemma's `num_key_value_groups` (query heads per key/value head) is 2
    beside 2 key/value heads; T5's head size (8) is a heads count by the
    same rule as its 4 heads, and its 32 position buckets a width. Where
    the check fails with every count, each attribute name is left whole in
    turn, then each pair of names, then each is counted alone; then the
    same from the counts with those that are heads only where heads and
    head size swap (`per_rank_counts(..., swapped=True)`); the first plan
    that passes so is kept. A rank's run stops at its first problem, so
    one that no count causes (another block's reshape) fails every trial
    that gets that far: where none passes, the trial whose first problem
    comes latest, past the first check's, is kept with its problems, so
    that only those fall back and the next check, without them, tries
    the counts again. Arguments and result as `local_problems`'.
    """

    def problems_with(counts):
        plan.per_rank_counts = counts
        return local_problems(
            model, plan, trace, group_of, random_inputs, units_only
        )

    problems = problems_with(plan.per_rank_counts)
    if not problems:
        return problems
    kept = plan.per_rank_counts
    trials = _trials(kept)
    swapped = per_rank_counts(model, plan, swapped=True)
    if swapped != kept:
        swapped = {
            layer: {**swapped.get(layer, {}), **kept.get(layer, {})}
            for layer in {**swapped, **kept}
        }
        trials += [swapped, *_trials(swapped)]
    best = kept, problems, _reached(trace, group_of, problems)
    for counts in trials:
        left = problems_with(counts)
        if not left:
            return {}
        reached = _reached(trace, group_of, left)
        if reached > best[2]:
            best = counts, left, reached
    plan.per_rank_counts, problems, _ = best
    return problems


def _reached(trace, group_of, problems):
    """How far a rank's run got: the first traced call of a layer of the
    first of `problems`' groups (-1 for a problem of a layer path, such
    as tied weights, which the run finds only at its end)."""
    first = {}
    for call in trace.calls:
        group = group_of.get(id(call.layer))
        if group is not None:
            first.setdefault(group, call.index)
    return min((first.get(key, -1) for key in problems), default=-1)


def keep_needed_counts(model, plan, trace, group_of, units_only=False):
    """Keeps only the per-rank head counts that the check needs.

    `plan.per_rank_counts` holds every integer attribute equal to a
    heads count; one may be so by chance (a sliding window of 4 beside 4
    heads). Each attribute name is dropped in turn, for good where every
    rank's view still gives the one-device numbers without it: an
    attribute keeps its value unless reading the rank's count is what
    makes the rank right.

    Args:
        model: the model `plan` is bound to.
        plan: a bound plan that passes the check.
        trace: the `Trace` of `model`.
        group_of: `{id(layer): group key}`, as for `local_problems`.
    """
    for name in sorted(_count_names(plan)):
        kept = plan.per_rank_counts
        plan.per_rank_counts = _without(kept, [name])
        if local_problems(model, plan, trace, group_of, units_only=units_only):
            plan.per_rank_counts = kept


def _trials(per_rank_counts):
    """`per_rank_counts` less each name (an attribute, or an argument
    whose shape matched a heads count, which may be so by chance: Moonshine's
    rotary table, 4 wide beside 4 heads), each pair of names, and all
    names but one, in turn."""
    names = sorted(
        {name for counts in per_rank_counts.values() for name in counts}
    )
    trials = [_without(per_rank_counts, [name]) for name in names]
    trials += [
        _without(per_rank_counts, pair)
        for pair in itertools.combinations(names, 2)
    ]
    if len(names) > 2:
        trials += [
            _without(per_rank_counts, [n for n in names if n != name])
            for name in names
        ]
    return trials


def _count_names(plan):
    return {name for counts in plan.per_rank_counts.values() for name in counts}


def _without(per_rank_counts, names):
    """`per_rank_counts` less the attributes, weights and head arguments
    `names`; a `FeatureArgument`, found from the dataflow, stays."""
    kept = {
        layer: {
            n: count
            for n, count in counts.items()
            if n not in names or isinstance(count, FeatureArgument)
        }
        for layer, counts in per_rank_counts.items()
    }
    return {layer: counts for layer, counts in kept.items() if counts}
