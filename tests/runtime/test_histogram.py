"""Latency histograms carried as counters (`runtime/histogram.py`): an observation lands in the bucket Prometheus
means by `le` (value <= bound), and every counter name parses back to its metric, label and bound."""

from __future__ import annotations

import pytest

from kvproc.runtime.histogram import LATENCY_BUCKETS_S, Histogram, parse_key


def test_an_observation_on_a_bound_counts_in_that_bucket_and_one_above_in_the_next() -> None:
    h = Histogram("resolve_latency_seconds", "host")
    one_ms = 1_000_000
    assert h.keys(one_ms) == (("hist.resolve_latency_seconds.host.le_0.001", 1),
                              ("hist.resolve_latency_seconds.host.sum_ns", one_ms))
    assert h.keys(one_ms + 1)[0][0] == "hist.resolve_latency_seconds.host.le_0.0025"
    assert h.keys(0)[0][0] == "hist.resolve_latency_seconds.host.le_5e-05"
    assert h.keys(11 * 10**9)[0][0] == "hist.resolve_latency_seconds.host.le_inf"


def test_every_counter_name_parses_back_and_others_do_not() -> None:
    h = Histogram("copy_latency_seconds", "load")
    seen = {parse_key(h.keys(round(b * 1e9))[0][0]) for b in LATENCY_BUCKETS_S}
    assert seen == {("copy_latency_seconds", "load", b) for b in LATENCY_BUCKETS_S}
    assert parse_key(h.keys(10**12)[0][0]) == ("copy_latency_seconds", "load", float("inf"))
    assert parse_key(h.sum_key) == ("copy_latency_seconds", "load", None)
    assert parse_key("store.prefix_cache_queries") is None
    assert parse_key("hist.not a histogram") is None


def test_unsorted_buckets_or_odd_names_are_refused() -> None:
    with pytest.raises(ValueError, match="increasing"):
        Histogram("x_seconds", "a", (0.1, 0.01))
    with pytest.raises(ValueError, match="names"):
        Histogram("x_seconds", "a.b")
