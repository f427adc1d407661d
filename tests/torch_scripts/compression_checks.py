"""Run on every rank by `keras_tp.launch` in tests/test_torch_compression.py."""

from tests import compression_cases
from tests.torch_scripts.rank_checks import _all_ranks


def checks(layouts, directory):
    """`compression_cases.rank_checks`; every rank's results, by rank."""
    return _all_ranks(compression_cases.rank_checks(layouts, directory))
