"""Reshapes to a width a layer's code reads from its whole input, per rank.

keras-hub's Swin window attention folds its heads back into features with
the width of its input: `ops.reshape(x, (B_, N, C))`, with `C` read from
the shape of the hidden states it was called on, which every rank holds
whole. On a rank `x` holds its heads only, `C / T` features, and the
reshape fails: the width is no attribute of the layer, so no per-rank
count (`head_counts`) reaches it.

Such a width is a rank's width where three things hold, each checked:

- found from the trace (`add_rank_widths`): it is the full width of a
  split sublayer's features (the Row's input, folding heads and head
  size), and the last axis of a tensor the layer is called on in every
  traced call. The layer's counts then hold `{RESHAPE: RankWidths}`;
- at the call (`_rank_target`): `ops.reshape` keeps the leading axes of
  its tensor and merges the rest into its last axis, of that full width,
  which only `T` times as many values would fill: it reads the rank's
  width there. A reshape that would run as written is never changed;
- the plan's check runs every rank's view of the layer so, against one
  device's numbers, and drops the entry where it is not needed (as every
  count); a rank whose merged axes are not its slice of the one-device
  ones fails the check, and the group falls back to gathering.

The call reads it where `head_counts.local_counts` runs the layer (the
check's view of a rank, and a rank's call at run time). `keras.ops.reshape`
is wrapped once, as keras-hub's code calls it; it defers to Keras' own
outside such a call.
"""

import contextlib
import contextvars
import functools
import numbers

import numpy as np

from keras_tp.keras_internals import keras_reshape
from keras_tp.keras_internals import reshape_through
from keras_tp.keras_internals import sublayers
from keras_tp.plan.styles import Column
from keras_tp.plan.styles import Row

# The name `RankWidths` stands under in a layer's per-rank counts: no
# attribute's name, so that it is never assigned to the layer.
RESHAPE = "ops.reshape"

# The `RankWidths` of the innermost call that reads them, in this thread
# (TensorFlow's replicas call layers in threads of their own).
_WIDTHS = contextvars.ContextVar("keras_tp_rank_widths", default=None)


class RankWidths(dict):
    """`{full width: the rank's width}` that `ops.reshape` reads in a
    layer's call (see the module docstring)."""

    def __repr__(self):
        return f"RankWidths({dict.__repr__(self)})"


def add_rank_widths(model, plan, trace):
    """Adds `{RESHAPE: RankWidths}` to `plan.per_rank_counts` for each
    layer whose direct sublayers split features of a width that is also
    the last axis of a tensor the layer is called on, in every traced
    call (Swin's window attention: its output projection's input is as
    wide as its hidden states)."""
    entries = {id(entry.layer): entry for entry in plan.leaf_layers()}
    regions = {id(entry.layer) for entry in plan.layers}
    for layer in [model, *sublayers(model)]:
        if id(layer) in regions or not trace.calls_of[id(layer)]:
            continue
        widths = {
            _split_width(entries[id(sub)])
            for sub in sublayers(layer, recursive=False)
            if id(sub) in entries
        }
        widths = {
            width
            for width in widths - {None}
            if width % plan.tensor_parallel == 0
            and all(
                any(
                    tensor.shape and tensor.shape[-1] == width
                    for tensor in call.inputs
                )
                for call in trace.calls_of[id(layer)]
            )
        }
        if widths:
            plan.per_rank_counts[layer] = {
                **plan.per_rank_counts.get(layer, {}),
                RESHAPE: RankWidths(
                    {w: w // plan.tensor_parallel for w in sorted(widths)}
                ),
            }


def split_features(entry):
    """`(shape, axis, last)` of a split leaf layer whose code sees split
    features: its primary kernel's shape, the split axis, and the axis of
    the head size after it (`axis == last` where the split axis folds
    heads and head size into one, a `Dense`'s); `None` where it gathers or
    slices (the layer's code then sees whole values)."""
    style = entry.style
    if isinstance(style, Column) and not style.gather_output:
        features_after = 1  # the head size
    elif isinstance(style, Row) and style.input_is_parallel:
        features_after = 2  # the head size, then the output features
    else:
        return None
    role = entry.handler.primary_role(entry.layer)
    axis = entry.axes.get(role)
    shape = tuple(entry.handler.variables(entry.layer)[role].shape)
    last = len(shape) - features_after
    if axis is None or axis > last:
        return None
    return shape, axis, last


def _split_width(entry):
    """The full width of the features a split leaf layer divides (its
    split axis and the head size after it), or `None`."""
    found = split_features(entry)
    if found is None:
        return None
    shape, axis, last = found
    return int(np.prod(shape[axis : last + 1]))


@contextlib.contextmanager
def rank_widths(widths):
    """Inside, `keras.ops.reshape` reads `widths` (a `RankWidths`, or
    `None` for none) as `_rank_target` says."""
    if not widths:
        yield
        return
    reshape_through(_reshape_to_rank_widths)
    token = _WIDTHS.set(widths)
    try:
        yield
    finally:
        _WIDTHS.reset(token)


@functools.wraps(keras_reshape)
def _reshape_to_rank_widths(x, newshape):
    """`keras.ops.reshape`, reading the rank's width inside a call that
    `rank_widths` runs."""
    widths = _WIDTHS.get()
    if widths:
        newshape = _rank_target(x, newshape, widths) or newshape
    return keras_reshape(x, newshape)


def _rank_target(x, target, widths):
    """`target` with the rank's width for a full one, or `None`.

    `target` must keep every axis of `x`'s shape but its last, which must
    be a full width in `widths`, and `x`'s axes from there on must hold
    exactly the rank's width: the reshape merges the rank's trailing axes
    (its heads and head size) into its part of the features, the last
    axis a Row reads. As written it would fail (`T` times too few
    values)."""
    try:
        shape = tuple(x.shape)
    except (AttributeError, TypeError, ValueError):
        return None  # no shape, or one of unknown rank while tracing
    if not isinstance(target, (tuple, list)) or not target:
        return None
    *kept, width = target
    if len(kept) >= len(shape) or not all(map(_same, shape, kept)):
        return None
    merged = shape[len(kept) :]
    if not (_known(width) and all(_known(n) for n in merged)):
        return None
    local = widths.get(int(width))
    if local is None or int(np.prod(merged)) != local:
        return None
    return (*kept, local)


def _known(n):
    return isinstance(n, numbers.Integral) and not isinstance(n, bool)


def _same(have, want):
    """Whether a target axis keeps the tensor's: the same length, or a
    length unknown while tracing on both sides."""
    if _known(have) and _known(want):
        return int(have) == int(want)
    return have is None and not _known(want)
