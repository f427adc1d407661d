"""Small helpers on tensors of any backend: their bytes, their dtype kind,
their Keras masks, scaling and concatenating many, and collectives over
many tensors at once.

They use only `keras.ops`, `keras.backend` and `keras_internals`, so the
plan, the optimizer, the runtimes and the collectives share them without
importing each other.
"""

import math

import keras
import ml_dtypes
import numpy as np
from keras import ops

from keras_tp.keras_internals import get_keras_mask
from keras_tp.keras_internals import set_keras_mask


def nbytes(x, shape=None):
    """Bytes of a tensor (or variable) of any backend, from shape and dtype.

    Args:
        x: the tensor or variable; only its dtype is read if `shape` is set.
        shape: the shape to count instead of `x.shape`.

    Returns:
        The number of bytes, an `int`.
    """
    dtype = keras.backend.standardize_dtype(x.dtype)
    # ml_dtypes names the dtypes NumPy lacks (bfloat16, float8_*).
    itemsize = np.dtype(getattr(ml_dtypes, dtype, dtype)).itemsize
    shape = x.shape if shape is None else shape
    return math.prod(int(dim) for dim in shape) * itemsize


def is_float(x):
    """Whether `x` is a tensor of a floating-point dtype, on any backend."""
    if not (hasattr(x, "dtype") and hasattr(x, "shape")):
        return False
    return keras.backend.is_float_dtype(
        keras.backend.standardize_dtype(x.dtype)
    )


def scaled(tensors, factor):
    """Each of `tensors` times `factor`, cast to its dtype."""
    return [ops.multiply(t, ops.cast(factor, t.dtype)) for t in tensors]


def concatenated(structures):
    """Like structures concatenated along their first (batch) axis."""
    if len(structures) == 1:
        return structures[0]
    return keras.tree.map_structure(
        lambda *parts: ops.concatenate(parts, 0), *structures
    )


def floats_of(structure):
    """The floating-point tensors of `structure`, in `keras.tree` order."""
    return [t for t in keras.tree.flatten(structure) if is_float(t)]


def counted_once(sources, gradients):
    """`gradients` of the tensors `sources` (a structure), each tensor's at
    its first place only, zeros at its others.

    A model may return one tensor as two of its outputs. A gradient tape
    gives each place of it the whole gradient, and a backward pass from
    those places, fed them as output gradients, would add them up again.
    """
    seen = set()

    def once(source, gradient):
        if id(source) in seen:
            return ops.zeros_like(gradient)
        seen.add(id(source))
        return gradient

    return keras.tree.map_structure(once, sources, gradients)


def with_floats_replaced(structure):
    """`(floats_of(structure), rebuild)`: `rebuild(new_floats)` is
    `structure` with `new_floats` in their places (a function to
    differentiate with respect to its floats alone)."""
    leaves = keras.tree.flatten(structure)
    floats = [is_float(leaf) for leaf in leaves]

    def rebuild(new_floats):
        new = iter(new_floats)
        replaced = [next(new) if f else x for x, f in zip(leaves, floats)]
        return keras.tree.pack_sequence_as(structure, replaced)

    return [x for x, f in zip(leaves, floats) if f], rebuild


def collect_flat(tensors, collective):
    """Runs `collective` once per dtype on `tensors` joined flat.

    One collective of the summed size costs one latency instead of one per
    tensor; the results are cut back into the tensors' shapes.

    Args:
        tensors: the tensors.
        collective: function of a flat vector (an all-reduce, say)
            returning a vector of the same size and dtype.

    Returns:
        The list of the collective's results, one per tensor, in order.
    """
    by_dtype = {}
    for i, tensor in enumerate(tensors):
        dtype = keras.backend.standardize_dtype(tensor.dtype)
        by_dtype.setdefault(dtype, []).append(i)
    results = [None] * len(tensors)
    for indices in by_dtype.values():
        pieces = [tensors[i] for i in indices]
        flat = collective(
            ops.concatenate([ops.reshape(p, (-1,)) for p in pieces])
        )
        offset = 0
        for i, piece in zip(indices, pieces):
            size = math.prod(int(dim) for dim in piece.shape)
            results[i] = ops.reshape(
                flat[offset : offset + size], tuple(piece.shape)
            )
            offset += size
    return results


def carried_masks(structure):
    """`{flat index: mask}` of the tensors of `structure` that carry a
    Keras mask (an `Embedding(mask_zero=True)`'s, passed down the layers)."""
    leaves = keras.tree.flatten(structure)
    masks = {i: get_keras_mask(leaf) for i, leaf in enumerate(leaves)}
    return {i: mask for i, mask in masks.items() if mask is not None}


def with_masks(structure, masks):
    """`structure`, its tensors carrying `masks` (as `carried_masks`)."""
    leaves = keras.tree.flatten(structure)
    for i, mask in masks.items():
        set_keras_mask(leaves[i], mask)
    return structure


class WithMask(keras.layers.Layer):
    """`WithMask()([tensor, mask])`: `tensor`, carrying `mask` (integers)
    as its Keras mask again, for the layers after it and a masked loss
    (a tensor a pipeline stage received across its cut)."""

    def call(self, inputs):
        return inputs[0]

    def compute_mask(self, inputs, mask=None):
        return ops.cast(inputs[1], "bool")
