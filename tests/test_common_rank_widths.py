"""`keras_tp.plan.rank_widths`: a reshape to a width read from a whole
input's shape, on a rank's part.

Backend-free (NumPy inputs); runs under any `KERAS_BACKEND`.
"""

import keras
import numpy as np
import pytest

from keras_tp.plan.rank_widths import RankWidths
from keras_tp.plan.rank_widths import rank_widths

# Swin's window attention at TP=2: 8 windows of 16 tokens, 2 heads of 8
# (width 16); a rank holds 1 head.
WIDTHS = RankWidths({16: 8})
HEADS = np.arange(8 * 16 * 1 * 8, dtype="float32").reshape(8, 16, 1, 8)


def _shape(x):
    return tuple(keras.ops.convert_to_numpy(x).shape)


def test_a_rank_folds_its_heads_into_its_part_of_the_width():
    with rank_widths(WIDTHS):
        folded = keras.ops.reshape(HEADS, (8, 16, 16))
    assert np.array_equal(
        keras.ops.convert_to_numpy(folded), HEADS.reshape(8, 16, 8)
    )


def test_a_reshape_that_runs_as_written_is_unchanged():
    whole = np.zeros((8, 16, 2, 8), "float32")
    with rank_widths(WIDTHS):
        assert _shape(keras.ops.reshape(whole, (8, 16, 16))) == (8, 16, 16)
        assert _shape(keras.ops.reshape(HEADS, (8, 16, -1))) == (8, 16, 8)


def test_only_the_last_axis_merging_the_trailing_axes_reads_it():
    # The heads before the tokens (no transpose), 16 tokens as wide as
    # the width: the width is not the last axis, so nothing is read and
    # the reshape fails as written (the plan's check then falls back).
    heads_first = np.zeros((8, 1, 16, 8), "float32")
    with rank_widths(WIDTHS), pytest.raises(Exception):
        keras.ops.reshape(heads_first, (8, 16, 16))
    # Another width than the rank's: as written.
    with rank_widths(RankWidths({32: 16})), pytest.raises(Exception):
        keras.ops.reshape(HEADS, (8, 16, 16))


def test_outside_a_rank_s_call_keras_reshapes_as_written():
    with rank_widths(WIDTHS):
        pass
    with pytest.raises(Exception):
        keras.ops.reshape(HEADS, (8, 16, 16))
