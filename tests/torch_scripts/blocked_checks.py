"""Run on every rank by `keras_tp.launch` in tests/test_torch_zoo.py."""

from tests import blocked_cases
from tests.torch_scripts.rank_checks import _all_ranks


def blocked_checks(world_size, directory):
    """`blocked_cases.blocked_results`; every rank's results."""
    return _all_ranks(blocked_cases.blocked_results(world_size, directory))
