"""How the plan's checks compare a rank's numbers with one device's."""

import numpy as np
from keras import ops

from keras_tp.blocks import rank_part

# Relative to the largest magnitude of the one-device value: the round-off
# of a sliced float32 matmul (at most 1e-7 on the keras-hub families) is far
# below it, a wrong split far above, however small the values (activations
# of fresh weights are). 16-bit floats round at 1e-3.
_TOLERANCE = 1e-4
_HALF_TOLERANCE = 1e-2


def as_numpy(x):
    """A tensor of any backend as a NumPy array."""
    return np.asarray(ops.convert_to_numpy(x))


def slice_tensor(variable, parts, axis, rank, blocks=1):
    """Slice `rank` of `parts` of a variable on `axis` (all of it for
    `None`), as a tensor of its dtype: its slice of each of `blocks`
    blocks where it holds several (`keras_tp.blocks`)."""
    value = as_numpy(variable)
    if axis is not None and blocks > 1:
        value = rank_part(value, axis, rank, parts, blocks)
    elif axis is not None:
        value = np.array_split(value, parts, axis)[rank]
    return ops.convert_to_tensor(value, dtype=variable.dtype)


def close_to(a, b):
    """Whether NumPy array `a` (a rank's) equals `b` (one device's) up to
    round-off: exactly where they are not floats."""
    if a.dtype.kind not in "fc":
        return np.array_equal(a, b)
    half = min(a.dtype.itemsize, b.dtype.itemsize) <= 2
    tolerance = _HALF_TOLERANCE if half else _TOLERANCE
    a, b = a.astype("float64"), b.astype("float64")
    scale = float(np.max(np.abs(b), initial=0.0))
    difference = float(np.max(np.abs(a - b), initial=0.0))
    return difference <= tolerance * scale + np.finfo("float32").tiny
