"""The gradient bucket size, chosen from a measured latency and bandwidth.

A collective call of `n` bytes takes about `latency + n / bandwidth`
seconds. Small buckets start sending sooner (more overlap with the
backward pass, less memory for the flat buffer) but pay the latency once
per call; large buckets amortise it. `bucket_cap_mb="auto"` times
all-reduces of a few sizes over the data axis, fits that line, and picks
the smallest bucket whose latency is at most `LATENCY_SHARE` of its call's
time: `n = latency * bandwidth * (1 - share) / share`, kept between
`SMALLEST_MB` and `LARGEST_MB`.
"""

import dataclasses
import logging

import numpy as np

logger = logging.getLogger(__name__)

# All-reduce sizes the probe times, in bytes: 4 KiB to 16 MiB.
PROBE_BYTES = (2**12, 2**16, 2**20, 2**24)
PROBE_REPEATS = 5
LATENCY_SHARE = 0.1
SMALLEST_MB = 1.0
LARGEST_MB = 100.0


@dataclasses.dataclass(frozen=True)
class LinkProbe:
    """What a probe of the data axis measured, and the bucket it implies.

    Attributes:
        times: median seconds of one all-reduce, by its size in bytes.
        latency: the fitted seconds per call.
        bandwidth: the fitted bytes per second (`inf` where the times did
            not grow with the size).
        bucket_cap_mb: the chosen `bucket_cap_mb`.
    """

    times: dict
    latency: float
    bandwidth: float
    bucket_cap_mb: float

    def describe(self):
        """A JSON-ready summary, for `get_gradient_sharding_info()`."""
        return {
            "latency_us": round(self.latency * 1e6, 2),
            "bandwidth_gb_per_s": round(self.bandwidth / 1e9, 3),
            "bucket_cap_mb": round(self.bucket_cap_mb, 3),
            "times_us": {
                size: round(seconds * 1e6, 2)
                for size, seconds in self.times.items()
            },
        }


def probe_link(time_all_reduce, sizes=PROBE_BYTES, repeats=PROBE_REPEATS):
    """Times all-reduces over the data axis and picks the bucket size.

    Args:
        time_all_reduce: the runtime's timer: a function of `(nbytes,
            repeats)` returning the median seconds of an all-reduce of
            `nbytes` over the data axis, the same on every rank.
        sizes: the sizes to time, in bytes.
        repeats: timed calls per size (after one untimed warm-up call).

    Returns:
        A `LinkProbe`.
    """
    times = {int(n): float(time_all_reduce(int(n), repeats)) for n in sizes}
    slope, intercept = np.polyfit(list(times), list(times.values()), 1)
    # Noise can tilt a line through near-constant times below zero.
    latency = max(float(intercept), min(times.values()) / 2)
    bandwidth = float(1.0 / slope) if slope > 0 else float("inf")
    return LinkProbe(
        times, latency, bandwidth, bucket_cap_mb(latency, bandwidth)
    )


def bucket_cap_mb(latency, bandwidth, share=LATENCY_SHARE):
    """The smallest bucket whose latency is `share` of its call's time.

    Args:
        latency: seconds per call.
        bandwidth: bytes per second.
        share: the largest fraction of a call the latency may take.

    Returns:
        Megabytes, between `SMALLEST_MB` and `LARGEST_MB`.
    """
    if not np.isfinite(bandwidth):
        return LARGEST_MB
    nbytes = latency * bandwidth * (1 - share) / share
    return float(np.clip(nbytes / 2**20, SMALLEST_MB, LARGEST_MB))


def check_bucket_cap_mb(bucket_cap_mb):
    """Refuses a `bucket_cap_mb` that is neither a size nor `"auto"`."""
    if bucket_cap_mb != "auto" and not (
        isinstance(bucket_cap_mb, (int, float)) and bucket_cap_mb > 0
    ):
        raise ValueError(
            f"bucket_cap_mb must be a number > 0 or 'auto', got "
            f"{bucket_cap_mb!r}."
        )


def probe_for(bucket_cap_mb, data_parallel, time_all_reduce):
    """`probe_link` where `bucket_cap_mb="auto"` has a data axis to time.

    Args:
        bucket_cap_mb: the optimizer's `bucket_cap_mb`.
        data_parallel: the size of the data axis.
        time_all_reduce: the runtime's timer (see `probe_link`).

    Returns:
        A `LinkProbe`, or `None` for a fixed size or without a data axis.
    """
    if bucket_cap_mb != "auto" or data_parallel == 1:
        return None
    probe = probe_link(time_all_reduce)
    logger.info("bucket_cap_mb='auto': %s", probe.describe())
    return probe


def chosen_cap_mb(bucket_cap_mb, link_probe):
    """The bucket size in use, in megabytes.

    Args:
        bucket_cap_mb: the optimizer's `bucket_cap_mb`: a size or `"auto"`.
        link_probe: what `probe_link` measured for `"auto"`, or `None`
            where there was no data axis to measure, and nothing is sent:
            any size does.
    """
    if bucket_cap_mb != "auto":
        return bucket_cap_mb
    if link_probe is None:
        return LARGEST_MB
    return link_probe.bucket_cap_mb
