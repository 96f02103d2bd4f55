"""Latency histograms carried as flat integer counters, so they travel wherever counters already do.

Every process reports its counters as a flat {name: int} (a role's `StatsReport`, the store's `counters_flat`); a
histogram rides in the same dict as one counter per bucket plus a sum, and `kvproc/runtime/metrics.py` turns them
back into a Prometheus histogram (`_bucket{le}`, `_sum`, `_count`). No second transport, no shared table between
the process that observes and the one that exports: the bucket bound is in the counter's name.

    hist.<metric>.<label value>.le_<bound seconds>   observations <= bound and > the previous bound (not cumulative)
    hist.<metric>.<label value>.le_inf               observations above the last bound
    hist.<metric>.<label value>.sum_ns               their sum, in nanoseconds

An observation costs a bisect and one locked update of three counters (by the caller's own counter lock).
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence

PREFIX = "hist."
# Seconds. Like vLLM's latency buckets, spaced for the range the thing spans: a device-only resolve is tens of
# microseconds, a host hit hundreds, a resolve that waits runs into its deadline (seconds).
LATENCY_BUCKETS_S: tuple[float, ...] = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                        0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_KEY = re.compile(r"^hist\.([a-z_]+)\.([A-Za-z0-9_]+)\.(le_[0-9.e+-]+|le_inf|sum_ns)$")


class Histogram:
    """The counter names of one histogram series (`metric` with one label value): `keys(ns)` says which to bump."""

    __slots__ = ("_bucket_keys", "bounds_ns", "sum_key")

    def __init__(self, metric: str, label: str, buckets_s: Sequence[float] = LATENCY_BUCKETS_S) -> None:
        if list(buckets_s) != sorted(set(buckets_s)):
            raise ValueError(f"histogram buckets must be strictly increasing: {buckets_s}")
        base = f"{PREFIX}{metric}.{label}."
        self.bounds_ns = [round(b * 1e9) for b in buckets_s]
        self._bucket_keys = [f"{base}le_{b:g}" for b in buckets_s] + [f"{base}le_inf"]
        self.sum_key = f"{base}sum_ns"
        if not _KEY.match(self.sum_key):
            raise ValueError(f"histogram {metric!r}/{label!r}: names must be [a-z_]+ and [A-Za-z0-9_]+")

    def keys(self, ns: int) -> tuple[tuple[str, int], tuple[str, int]]:
        """((bucket counter, 1), (sum counter, ns)): the increments one observation of `ns` nanoseconds makes."""
        return (self._bucket_keys[bisect.bisect_left(self.bounds_ns, ns)], 1), (self.sum_key, ns)


def parse_key(name: str) -> tuple[str, str, float | None] | None:
    """`hist.<metric>.<label>.<part>` -> (metric, label, bucket bound in s: inf for le_inf, None for the sum);
    None for a counter that is no histogram's."""
    if not name.startswith(PREFIX):
        return None
    match = _KEY.match(name)
    if match is None:
        return None
    part = match[3]
    bound = None if part == "sum_ns" else float("inf") if part == "le_inf" else float(part[3:])
    return match[1], match[2], bound


def is_histogram_key(name: str) -> bool:
    return name.startswith(PREFIX)
