"""Splits of a fused projection laid out block by block.

A fused projection (Swin's query-key-value `Dense(3 * dim)`, a SwiGLU's
gate-and-up `Dense(2 * intermediate)`) holds `blocks` blocks side by
side on its output axis, and the code after it reads each block's heads.
Megatron gives rank `r` the `r`-th part of EACH block (`Column(blocks=b)`),
not one contiguous slice. keras_tp stores such a variable permuted on
that axis, each rank's parts of the blocks next to one another, so every
runtime splits it contiguously as any other variable; the full
(canonical) value is permuted on its way in and back on its way out.

Backend-free: NumPy index arrays, applied with `np.take` or
`keras.ops.take`.
"""

import numpy as np
from keras import ops


def stored_order(size, parts, blocks):
    """Where each stored position of a blocked axis comes from.

    Args:
        size: the length of the axis.
        parts: the number of ranks it is split over.
        blocks: the number of blocks laid side by side on it.

    Returns:
        An int array: stored position `i` holds canonical position
        `order[i]`. The stored axis is rank 0's part of every block, then
        rank 1's, and so on.
    """
    order = np.arange(size).reshape(blocks, parts, size // (blocks * parts))
    return order.transpose(1, 0, 2).reshape(-1)


def to_stored(value, axis, parts, blocks):
    """The stored (permuted) layout of a canonical `value` on `axis`.

    Args:
        value: a NumPy array or a tensor of any backend.
        axis: the blocked axis.
        parts: the number of ranks.
        blocks: the number of blocks; 1 leaves `value` as it is.

    Returns:
        `value` permuted, of the same kind.
    """
    if blocks == 1:
        return value
    return _take(value, stored_order(value.shape[axis], parts, blocks), axis)


def to_canonical(value, axis, parts, blocks):
    """The canonical layout of a stored `value`: `to_stored` undone."""
    if blocks == 1:
        return value
    order = stored_order(value.shape[axis], parts, blocks)
    return _take(value, np.argsort(order), axis)


def rank_part(value, axis, rank, parts, blocks=1):
    """Rank `rank`'s part of a canonical NumPy `value` on `axis`: its
    `rank`-th slice of each of the `blocks` blocks, concatenated."""
    size = value.shape[axis]
    width = size // parts
    order = stored_order(size, parts, blocks)
    return np.take(value, order[rank * width : (rank + 1) * width], axis)


def canonical_ranges(start, stop, size, parts, blocks):
    """The canonical ranges of a stored range `[start, stop)` of an axis.

    For a checkpoint, which holds canonical values: a rank's stored piece
    of a blocked variable is one range of each block.

    Args:
        start: the first stored position.
        stop: the stored position after the last.
        size: the length of the axis.
        parts: the number of ranks.
        blocks: the number of blocks.

    Returns:
        `[((stored_start, stored_stop), (start, stop))]`: each run of
        `[start, stop)` that is contiguous in the canonical value, with
        where it lies there, in stored order.
    """
    if blocks == 1:
        return [((start, stop), (start, stop))]
    order = stored_order(size, parts, blocks)
    ranges = []
    first = start
    for position in range(start + 1, stop + 1):
        if position == stop or order[position] != order[position - 1] + 1:
            canonical = int(order[first])
            ranges.append(
                ((first, position), (canonical, canonical + position - first))
            )
            first = position
    return ranges


def _take(value, indices, axis):
    if isinstance(value, np.ndarray):
        return np.take(value, indices, axis)
    return ops.take(value, ops.convert_to_tensor(indices), axis=axis)
