"""Run on every rank by `keras_tp.launch` in tests/test_torch_zoo.py."""

from tests import blocked_cases
from tests import zoo_cases
from tests.torch_scripts.rank_checks import _all_ranks


def blocked_checks(world_size, directory):
    """`blocked_cases.blocked_results`, with `zoo_cases.measure` of
    `fused_lora` under `"lora"`; every rank's results."""
    results = blocked_cases.blocked_results(world_size, directory)
    results["lora"] = zoo_cases.measure("fused_lora", world_size)
    return _all_ranks(results)
