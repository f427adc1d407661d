"""Run on every rank by `keras_tp.launch` in tests/test_torch_data_shares.py:
`tests/share_cases.py` on 2 ranks of one data-parallel row each."""

import os

from tests import share_cases
from tests.torch_scripts.rank_checks import _all_ranks


def shares():
    process = int(os.environ["RANK"])
    result = share_cases.shares(process, world_size=2, data_parallel=2)
    return _all_ranks(result)
