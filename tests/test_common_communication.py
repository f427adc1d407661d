"""How `CoordinatedOptimizer` groups ranks into hosts
(`hierarchical=True`) and sizes its buckets (`bucket_cap_mb="auto"`)."""

import pytest

from keras_tp.collectives.hierarchy import host_groups
from keras_tp.parallel import bucket_probe


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


def test_the_probe_fits_latency_and_bandwidth_and_picks_the_bucket():
    # 200 us per call and 2 GB/s: latency is a tenth of a call's time at
    # 9 x 200e-6 x 2e9 bytes = 3.6 MB = 3.43 MiB.
    calls = []

    def timer(nbytes, repeats):
        calls.append((nbytes, repeats))
        return 200e-6 + nbytes / 2e9

    probe = bucket_probe.probe_link(timer)
    assert [n for n, _ in calls] == list(bucket_probe.PROBE_BYTES)
    assert probe.latency == pytest.approx(200e-6)
    assert probe.bandwidth == pytest.approx(2e9)
    assert probe.bucket_cap_mb == pytest.approx(3.6e6 / 2**20)
    assert probe.describe()["latency_us"] == pytest.approx(200.0)


def test_the_bucket_stays_within_its_bounds():
    # A fast network with a slow start wants huge buckets, and the
    # opposite tiny ones; times that do not grow give the largest.
    assert bucket_probe.bucket_cap_mb(1.0, 1e12) == bucket_probe.LARGEST_MB
    assert bucket_probe.bucket_cap_mb(1e-7, 1e8) == bucket_probe.SMALLEST_MB
    flat = bucket_probe.probe_link(lambda nbytes, repeats: 1e-4)
    assert flat.bucket_cap_mb == bucket_probe.LARGEST_MB
