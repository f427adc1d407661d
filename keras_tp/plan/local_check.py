"""Where ranks hold their own slices: the plan's check, and what it finds.

`verify.local_problems` runs every rank's view of a plan on one device.
This module runs it for a plan given by the user (`check_locally`), and
turns what it finds into what the runtime needs: the layers that draw
random numbers per rank, and the head counts each rank reads.
"""

from keras_tp.errors import ShardingError
from keras_tp.keras_internals import sublayers
from keras_tp.plan import trace as tracing
from keras_tp.plan.sharding_plan import ShardedUnit
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
    problems = local_problems(model, plan, trace, group_of, random_inputs)
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
    inside = {
        id(sub)
        for entry in plan.layers
        if isinstance(entry, ShardedUnit)
        for sub in sublayers(entry.layer)
    }
    return {
        layer: tuple(calls)
        for layer, calls in random_inputs.items()
        if id(layer) not in inside and any(calls)
    }


def keep_needed_counts(model, plan, trace, group_of):
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
    names = {
        name for counts in plan.per_rank_counts.values() for name in counts
    }
    for name in sorted(names):
        kept = plan.per_rank_counts
        plan.per_rank_counts = {
            layer: {n: count for n, count in counts.items() if n != name}
            for layer, counts in kept.items()
            if set(counts) != {name}
        }
        if local_problems(model, plan, trace, group_of):
            plan.per_rank_counts = kept
