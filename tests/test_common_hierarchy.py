"""How `CoordinatedOptimizer(hierarchical=True)` groups ranks into hosts."""

import pytest

from keras_tp.collectives.hierarchy import host_groups


def test_hosts_of_consecutive_ranks_make_the_two_levels():
    within, across = host_groups(["a", "a", "b", "b", "c", "c"])
    assert within == [[0, 1], [2, 3], [4, 5]]
    assert across == [[0, 2, 4], [1, 3, 5]]


@pytest.mark.parametrize(
    "hosts", [["a", "a", "b"], ["a", "b", "a", "b"]], ids=["uneven", "mixed"]
)
def test_hosts_that_cannot_be_levels_are_refused(hosts):
    with pytest.raises(ValueError, match="same number of consecutive"):
        host_groups(hosts)
