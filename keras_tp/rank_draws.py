"""Random draws on split activations: each rank a stream of its own.

A dropout inside a sharded region, or on a Column layer's features
between it and its Row partner, sees one rank's part of a tensor that one
device draws one mask for: the ranks draw from streams shifted by their
rank, while their seed generators' states advance alike.
"""

import contextvars

from keras_tp.keras_internals import own_seed_generators
from keras_tp.keras_internals import shifted_seed_draws

# How far apart the ranks' random streams start: distinct seeds for up to
# 2,000 ranks within the narrowest seed dtype (int32, on torch).
RANK_SEED_STRIDE = 1_000_003

# Per layer, its calls so far in the forward pass a runtime runs
# (`regions.forward_pass` sets it).
FORWARD_CALLS = contextvars.ContextVar("keras_tp_forward_calls", default=None)


def per_rank_draws(generators, call, runtime):
    """`call`, with `generators` drawing a random stream of their own per rank.

    Inside a sharded region the activations are split: attention heads,
    a Column layer's features. A dropout there must draw an independent
    mask for each rank's part, as one device draws one mask for the whole
    tensor; every rank starting from the same seed would repeat one mask
    on every part. The generators' states still advance alike on every
    rank (see `shifted_seed_draws`).

    Args:
        generators: the `SeedGenerator`s the call draws from.
        call: the per-rank function.
        runtime: the runtime whose `model`-axis adapter's `rank()` is
            read inside the call.

    Returns:
        The wrapped function (`call` itself if there is nothing to draw).
    """
    if not generators:
        return call

    def shift():
        return runtime.adapter.rank() * RANK_SEED_STRIDE

    def call_with_rank_draws(*args, **kwargs):
        with shifted_seed_draws(generators, shift):
            return call(*args, **kwargs)

    return call_with_rank_draws


def split_random_call(layer, split_calls, runtime):
    """A Dropout (say) that runs on split activations draws per rank.

    Args:
        layer: the layer.
        split_calls: for each of its calls in a forward pass, whether its
            input is split (see `local_check.random_on_split_values`).
        runtime: the runtime. Where it holds global values (JAX without a
            data axis) the layer runs on the whole tensor and draws one
            mask, as on one device.
    """
    whole_call = layer.call
    local_call = per_rank_draws(own_seed_generators(layer), whole_call, runtime)

    def call(*args, **kwargs):
        calls = FORWARD_CALLS.get()
        if calls is None:
            split = all(split_calls)
        else:
            index = calls.get(id(layer), 0)
            calls[id(layer)] = index + 1
            split = split_calls[index % len(split_calls)]
        if split and runtime.holds_local_values():
            return local_call(*args, **kwargs)
        return whole_call(*args, **kwargs)

    return call
