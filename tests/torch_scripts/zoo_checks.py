"""Run on every rank by `keras_tp.launch` in tests/test_torch_zoo.py."""

from tests import zoo_cases
from tests.torch_scripts.rank_checks import _all_ranks


def zoo_checks(names, world_size):
    """`zoo_cases.measure` of each model; every rank's results."""
    return _all_ranks(
        {name: zoo_cases.measure(name, world_size) for name in names}
    )
