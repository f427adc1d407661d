"""`keras_tp.blocks`: the stored layout of a variable split by blocks.

Backend-free (NumPy); runs under any `KERAS_BACKEND`.
"""

import numpy as np

from keras_tp import blocks


def test_each_rank_stores_its_slice_of_every_block_contiguously():
    # 3 blocks of 4 (q, k, v of 2 heads of 2) over 2 ranks.
    canonical = np.arange(12)
    stored = blocks.to_stored(canonical, 0, 2, 3)
    assert stored.tolist() == [0, 1, 4, 5, 8, 9, 2, 3, 6, 7, 10, 11]
    for rank in range(2):
        part = blocks.rank_part(canonical, 0, rank, 2, 3)
        assert np.array_equal(part, np.split(stored, 2)[rank])
    assert np.array_equal(blocks.to_canonical(stored, 0, 2, 3), canonical)


def test_one_block_is_a_contiguous_split():
    value = np.arange(24).reshape(2, 12)
    assert blocks.to_stored(value, 1, 4, 1) is value
    assert np.array_equal(
        blocks.rank_part(value, 1, 3, 4), np.split(value, 4, 1)[3]
    )


def test_a_stored_range_maps_to_one_canonical_run_per_block():
    # Rank 1's stored part, then half of it (a ZeRO partition).
    assert blocks.canonical_ranges(6, 12, 12, 2, 3) == [
        ((6, 8), (2, 4)),
        ((8, 10), (6, 8)),
        ((10, 12), (10, 12)),
    ]
    assert blocks.canonical_ranges(6, 9, 12, 2, 3) == [
        ((6, 8), (2, 4)),
        ((8, 9), (6, 7)),
    ]
    assert blocks.canonical_ranges(3, 7, 12, 2, 1) == [((3, 7), (3, 7))]
