"""Prometheus: one `/metrics` endpoint per cluster, served by the launcher's process from every process's counters.

A scrape asks every child for its `Stats` (the counters `kvproc console status` shows) and reads what the launcher's
process embeds (the store: `Cluster.counter_providers`), so a counter that exists in the console exists here with
the same meaning: `kvproc:counter{role, rank, name}` (a gauge: some console entries are levels, e.g. `in_flight`).
The ones an operator or a dashboard reads first are also named the way vLLM names its own:

- `kvproc:prefix_cache_queries_total`: prompt tokens resolved; `kvproc:prefix_cache_hits_total{tier}`: of those,
  tokens found in the device pool (`tier="device"`) or restored from the host tier (`tier="host"`);
- `kvproc:resolves_total{outcome, reason}`, `kvproc:saves_total{outcome, reason}`, `kvproc:loads_total{...}`:
  every async operation's terminal state (ok / degraded / failed / shed) and why;
- `kvproc:copy_bytes_total{direction}` / `kvproc:copy_seconds_total{direction}` (save, load, device), summed over
  the copy workers; `kvproc:process_up{role, rank}`, `kvproc:process_restarts_total{role, rank}`;
- histograms (vLLM's shape: `_bucket{le}`, `_sum`, `_count`, seconds): `kvproc:resolve_latency_seconds{hit}` and
  `kvproc:copy_latency_seconds{direction}`, summed over processes; they travel as counters (`runtime/histogram.py`).

Every metric carries `cluster`. Off unless asked: `ClusterStore.start(metrics="127.0.0.1:9400")`,
`kvproc up --metrics 127.0.0.1:9400`; port 0 picks a free one (`MetricsEndpoint.address` says which).
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Mapping

from kvproc.ipc import messages as m
from kvproc.ipc.errors import IpcError
from kvproc.runtime.histogram import LATENCY_BUCKETS_S, parse_key

if TYPE_CHECKING:
    from kvproc.runtime.launcher import Cluster

STATS_TIMEOUT_S = 1.0  # a child that does not answer within it is reported down for this scrape, never waited on
_OUTCOME = re.compile(r"^outcome\.(resolve|save|load|retire)\.([a-z_]+)(?:\.(.+))?$")
_COPY = {"save": ("bytes_save", "ns_save"), "load": ("bytes_load", "ns_load"), "device": ("bytes_device", "ns_device")}
INF = float("inf")
# a histogram's one label, by metric (`runtime/histogram.py` names the value only)
_HIST_LABEL = {"resolve_latency_seconds": "hit", "copy_latency_seconds": "direction"}
_HIST_HELP = {"resolve_latency_seconds": "resolve_prefix latency as the caller sees it, by what served the prefix",
              "copy_latency_seconds": "one copy order's time in the copy worker, by direction"}


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"metrics address {address!r} must look like HOST:PORT (e.g. 127.0.0.1:9400; port 0 picks one)")
    return host, int(port)


class ClusterCollector:
    """A prometheus_client collector: each `collect()` is one fresh read of the cluster (no cache to go stale)."""

    def __init__(self, cluster: "Cluster") -> None:
        self.cluster = cluster
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="kvproc-metrics")

    def _child_counters(self, role: str, rank: int) -> Mapping[str, int] | None:
        if not self.cluster.available(role, rank):
            return None
        try:
            report = self.cluster.client(role, rank).request(m.Stats(), timeout=STATS_TIMEOUT_S)
        except (IpcError, TimeoutError, KeyError):
            return None
        return dict(report.counters)

    def read(self) -> list[tuple[str, int, Mapping[str, int] | None]]:
        """(role, rank, counters or None when down) for the launcher's process and every child."""
        own: dict[str, int] = {}
        for provider in list(self.cluster.counter_providers):
            own.update(provider())
        members = self.cluster.members
        children = list(self._pool.map(lambda k: self._child_counters(*k), members))
        return [("launcher", 0, own)] + [(r, k, c) for (r, k), c in zip(members, children)]

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        name = self.cluster.name
        rows = self.read()
        up = GaugeMetricFamily("kvproc:process_up", "1 while the process answers its Stats", labels=["cluster", "role", "rank"])
        restarts = CounterMetricFamily("kvproc:process_restarts", "restarts of the process by the launcher",
                                       labels=["cluster", "role", "rank"])
        every = GaugeMetricFamily("kvproc:counter", "every counter `kvproc console status` shows, by process",
                                  labels=["cluster", "role", "rank", "name"])
        queries = CounterMetricFamily("kvproc:prefix_cache_queries", "prompt tokens resolved", labels=["cluster"])
        hits = CounterMetricFamily("kvproc:prefix_cache_hits", "resolved prompt tokens found, by tier",
                                   labels=["cluster", "tier"])
        ops = {op: CounterMetricFamily(f"kvproc:{op}s", f"{op} terminal states (ok/degraded/failed/shed) and why",
                                       labels=["cluster", "outcome", "reason"]) for op in ("resolve", "save", "load")}
        copy_bytes = CounterMetricFamily("kvproc:copy_bytes", "bytes moved by the copy workers",
                                         labels=["cluster", "direction"])
        copy_secs = CounterMetricFamily("kvproc:copy_seconds", "time the copy workers spent copying",
                                        labels=["cluster", "direction"])
        copied: dict[str, list[int]] = {d: [0, 0] for d in _COPY}
        hists: dict[tuple[str, str], dict[float | None, int]] = {}  # (metric, label) -> {bound (None: sum ns): n}
        for role, rank, counters in rows:
            up.add_metric([name, role, str(rank)], 0.0 if counters is None else 1.0)
            if role != "launcher":
                restarts.add_metric([name, role, str(rank)], float(self.cluster.restarts(role, rank)))
            for key, value in (counters or {}).items():
                parsed = parse_key(key)
                if parsed is None:
                    every.add_metric([name, role, str(rank), key], float(value))
                else:
                    series = hists.setdefault(parsed[:2], {})
                    series[parsed[2]] = series.get(parsed[2], 0) + int(value)
            if role == "copy_worker" and counters:
                for d, (b, ns) in _COPY.items():
                    copied[d][0] += int(counters.get(b, 0))
                    copied[d][1] += int(counters.get(ns, 0))
            if role == "launcher" and counters:
                queries.add_metric([name], float(counters.get("store.prefix_cache_queries", 0)))
                for tier in ("device", "host"):
                    hits.add_metric([name, tier], float(counters.get(f"store.prefix_cache_hits_{tier}", 0)))
                for key, value in counters.items():
                    match = _OUTCOME.match(key)
                    if match and match[1] in ops:
                        ops[match[1]].add_metric([name, match[2], match[3] or ""], float(value))
        for d, (nbytes, nanos) in copied.items():
            copy_bytes.add_metric([name, d], float(nbytes))
            copy_secs.add_metric([name, d], nanos / 1e9)
        yield from (up, restarts, queries, hits, *ops.values(), copy_bytes, copy_secs, *_histograms(name, hists), every)

    def close(self) -> None:
        self._pool.shutdown(wait=False)


def _histograms(cluster: str, hists: Mapping[tuple[str, str], Mapping[float | None, int]]) -> Iterator[Any]:
    """Prometheus histograms from per-bucket counts (not cumulative): cumulated in bound order, `+Inf` the count."""
    from prometheus_client.core import HistogramMetricFamily

    families: dict[str, Any] = {}
    for (metric, label), series in sorted(hists.items()):
        fam = families.get(metric)
        if fam is None:
            fam = families[metric] = HistogramMetricFamily(f"kvproc:{metric}", _HIST_HELP.get(metric, metric),
                                                           labels=["cluster", _HIST_LABEL.get(metric, "kind")])
        # every standard bound, observed or not (a bucket never hit has no counter): dashboards need a fixed set
        bounds = sorted(set(LATENCY_BUCKETS_S) | {b for b in series if b is not None and b != INF})
        total, buckets = 0, []
        for bound in bounds:
            total += series.get(bound, 0)
            buckets.append((f"{bound:g}", float(total)))
        buckets.append(("+Inf", float(total + series.get(INF, 0))))
        fam.add_metric([cluster, label], buckets, sum_value=series.get(None, 0) / 1e9)
    yield from families.values()


class MetricsEndpoint:
    """`/metrics` over HTTP on its own threads (a bounded pool: `http_pool.py`), reading `cluster` at every scrape."""

    def __init__(self, cluster: "Cluster", address: str) -> None:
        from prometheus_client import CollectorRegistry, make_wsgi_app

        from kvproc.runtime.http_pool import serve

        host, port = parse_address(address)
        self.collector = ClusterCollector(cluster)
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self.collector)
        # a bounded pool of threads, idle connections timed out (`http_pool.py`), not a thread per connection
        self._server, self._thread = serve(make_wsgi_app(self.registry), host, port)
        self.address = f"{host}:{self._server.server_port}"
        self.started_at = time.time()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)
        self.collector.close()
