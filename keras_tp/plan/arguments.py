"""Call arguments a rank reads its slice of.

Code between split layers may meet a tensor that its caller made whole:

- Falcon's decoder block makes the ALiBi bias for every head and passes
  it to its attention, which adds it to its own heads' scores
  (`HeadArgument`, found by `head_counts.add_head_arguments`);
- Gemma3n's decoder block multiplies its per-layer input into its gate's
  output, split by features, before the projection back
  (`FeatureArgument`, found from the dataflow by
  `feature_arguments.add_feature_arguments`).

A rank reads its slice of such an argument through `scatter_to_parallel`:
its slice forward, the gradient gathered whole from the ranks' slices.
"""

import itertools

import keras

from keras_tp.plan.attention import call_arguments


class HeadArgument(int):
    """The heads axis of a call argument made for every head by the
    layer's caller (see `add_head_arguments`), with the full `heads`
    count: an argument that arrives with fewer is a rank's already (T5's
    position bias, which its first attention layer computes from its
    heads' slice of the bias table and hands on to the next)."""

    def __new__(cls, axis, heads):
        argument = super().__new__(cls, axis)
        argument.heads = heads
        return argument

    def __getnewargs__(self):
        return int(self), self.heads

    def __repr__(self):
        return f"HeadArgument({int(self)}, heads={self.heads})"


class FeatureArgument(HeadArgument):
    """The split axis of a tensor in a call argument that the layer's own
    code multiplies into a split sublayer's features before they reach
    its Row partner (Gemma3n's per-layer input, multiplied into its
    gate's output): `part` is the tensor's position among the argument's
    tensors, `heads` the axis' full length. Found from the dataflow
    (`feature_arguments.add_feature_arguments`), it is no coincidence of
    shapes: the plan's check never drops it, and on global arrays it
    enters split too, through a counted `scatter_to_parallel`."""

    def __new__(cls, axis, width, part):
        argument = super().__new__(cls, axis, width)
        argument.part = part
        return argument

    def __getnewargs__(self):
        return int(self), self.heads, self.part

    def __repr__(self):
        return (
            f"FeatureArgument({int(self)}, width={self.heads}, "
            f"part={self.part})"
        )


def head_arguments(counts):
    """`{argument name: HeadArgument}` of a layer's `counts`."""
    return {
        name: axis
        for name, axis in counts.items()
        if isinstance(axis, HeadArgument)
    }


def feature_arguments(counts):
    """`{argument name: FeatureArgument}` of a layer's `counts`."""
    return {
        name: axis
        for name, axis in counts.items()
        if isinstance(axis, FeatureArgument)
    }


def local_arguments(layer, counts, head_slice, args, kwargs):
    """`(args, kwargs)` of a call of `layer`, with this rank's slice of
    each argument that `counts` holds a `HeadArgument` for."""
    axes = head_arguments(counts)
    if not axes:
        return args, kwargs

    def sliced(value, axis):
        if value.shape[axis] not in (axis.heads, None):
            return value  # a rank's heads already
        return head_slice(value, int(axis))

    def local(name, value):
        axis = axes.get(name)
        if axis is None or value is None:
            return value
        if not isinstance(axis, FeatureArgument):
            return sliced(value, axis)
        positions = itertools.count()

        def part(leaf):
            if not hasattr(leaf, "shape") or next(positions) != axis.part:
                return leaf
            return sliced(leaf, axis)

        return keras.tree.map_structure(part, value)

    names = call_arguments(layer)
    args = [
        local(names[i] if i < len(names) else None, value)
        for i, value in enumerate(args)
    ]
    return args, {name: local(name, value) for name, value in kwargs.items()}
