"""Attention layers split by heads, as one region, and their caches."""

import inspect

import keras

from keras_tp.keras_internals import ATTENTION_OUTPUT_PROJECTION
from keras_tp.keras_internals import attention_projections
from keras_tp.plan.styles import Column
from keras_tp.plan.styles import Row


class AttentionUnit:
    """MultiHeadAttention / GroupQueryAttention as one sharded region.

    Query, key, value (and gate) projections are Column on the heads axis,
    the output projection is Row, and the attention core between them runs
    unchanged on each rank's heads. So the block costs one all-reduce
    forward (after the output projection) and one backward (for the input).
    """

    layer_types = (
        keras.layers.MultiHeadAttention,
        keras.layers.GroupQueryAttention,
    )

    def matches(self, layer):
        return isinstance(layer, self.layer_types)

    def projections(self, layer):
        """`{attribute: sublayer}` of the projections, column ones first."""
        return attention_projections(layer)

    def heads(self, layer):
        """`(query_heads, key_value_heads)`."""
        if isinstance(layer, keras.layers.GroupQueryAttention):
            return layer.num_query_heads, layer.num_key_value_heads
        return layer.num_heads, layer.num_heads

    @staticmethod
    def projection_style(name):
        """The style of projection `name` when the unit is sharded."""
        return Row() if name == ATTENTION_OUTPUT_PROJECTION else Column()

    def output_axes(self, layer, kwargs, cache=None, cache_axis=None):
        """Output axes: the scores, if returned, stay split on heads, and
        a key/value `cache`, if given, comes last, split on `cache_axis`
        (see `key_value_cache_axis`)."""
        axes = [None]
        if kwargs.get("return_attention_scores"):
            axes.append(1)
        if cache is not None:
            axes.append(cache_axis)
        return tuple(axes) if len(axes) > 1 else None


ATTENTION = AttentionUnit()

# The call argument through which keras-hub's attention layers take their
# key/value cache in generation; they return the updated cache last.
CACHE_ARGUMENT = "cache"


def takes_cache(layer):
    """Whether `layer`'s call takes a key/value cache (`CACHE_ARGUMENT`)."""
    return CACHE_ARGUMENT in inspect.signature(type(layer).call).parameters


def key_value_cache_axis(projections, cache_shape, full_shape):
    """The axis on which an attention layer's whole key/value cache splits.

    A cache holds the key and value projections' outputs, so its heads sit
    where theirs do, counted from the end (`(batch, 2, length, heads,
    head_dim)` in keras-hub). A projection split by heads whose full head
    count the cache has there produced it. Where none did, the cache stays
    whole (key/value heads fewer than the ranks stay whole while the query
    heads are split), or it is one rank's share already (a rank's own
    update).

    Args:
        projections: the layer's split sublayers (`ShardedLayer`s).
        cache_shape: the shape of the cache the layer receives.
        full_shape: function giving a variable's unsplit shape (a rank
            may hold its slice only).

    Returns:
        The axis, or `None` where there is nothing to split.
    """
    for member in projections:
        if not isinstance(member.style, Column):
            continue
        axis = member.handler.output_axis(
            member.layer, member.style, len(cache_shape)
        )
        role = member.handler.primary_role(member.layer)
        variable = member.handler.variables(member.layer)[role]
        heads = full_shape(variable)[member.axes[role]]
        if axis is not None and cache_shape[axis] == heads:
            return axis
    return None


def call_arguments(layer):
    """The names of `layer`'s call arguments, from its class's `call` (an
    instance's is replaced by its region's)."""
    parameters = inspect.signature(type(layer).call).parameters
    return list(parameters)[1:]


def input_first(layer, call):
    """`call`, a replacement of `layer`'s, receiving the layer's first
    call argument by position where the caller named it: keras-hub's
    PaliGemma calls its vision encoder's Dense layers as `dense(inputs=x)`,
    and a split layer reads its input first."""
    names = call_arguments(layer)
    first = names[0] if names else None

    def positional_call(*args, **kwargs):
        if args or first not in kwargs:
            return call(*args, **kwargs)
        kwargs = dict(kwargs)
        return call(kwargs.pop(first), **kwargs)

    return positional_call


def named_arguments(layer, args, kwargs):
    """`[(name, value), ...]` of a call of `layer`'s arguments."""
    return [*zip(call_arguments(layer), args), *kwargs.items()]


def call_argument(layer, name, args, kwargs):
    """A call argument of `layer`, passed by position or by name."""
    names = call_arguments(layer)
    if name not in names:
        return kwargs.get(name)
    index = names.index(name)
    return args[index] if index < len(args) else kwargs.get(name)


def split_cache(layer, projections, args, kwargs, full_shape):
    """`(cache, axis)`: the key/value cache an attention `layer` takes in
    generation, and the axis it is split on with the heads of its split
    `projections` (`None`: nothing to split, see `key_value_cache_axis`);
    `(None, None)` without a cache, or for one that is not one tensor."""
    cache = call_argument(layer, CACHE_ARGUMENT, args, kwargs)
    if not hasattr(cache, "shape"):
        # None, or a structure of caches (`generation` splits each).
        return None, None
    axis = key_value_cache_axis(projections, tuple(cache.shape), full_shape)
    return cache, axis
