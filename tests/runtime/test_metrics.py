"""Prometheus `/metrics` of a running cluster (issue 21): scraped over HTTP and parsed as the text format; the hit
counters agree with the store's own, every process is there, and a bad or taken address fails before any child."""

from __future__ import annotations

import os
import signal
import socket
import time
import urllib.request
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvproc.ipc import messages as m
from kvproc.runtime import launch
from kvproc.runtime.config import RoleConfig
from tests.conftest import churn, cluster_store, compute, descendants, wait_for


def scrape(address: str) -> dict[str, list[Any]]:
    """{metric family name: its samples}, parsed from the text format an HTTP GET of /metrics returns."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as r:
        assert r.status == 200
        text = r.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(families: dict[str, list[Any]], sample: str, **labels: str) -> float:
    found = [s.value for fam in families.values() for s in fam
             if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())]
    assert len(found) == 1, (sample, labels, found)
    return float(found[0])


def test_a_scrape_reports_hits_by_tier_outcomes_copies_and_every_process_as_the_store_counts_them() -> None:
    with cluster_store(metrics="127.0.0.1:0") as (cs, store, model):
        address = cs.cluster.metrics.address
        toks = list(range(1, 18))
        kv, cur, _, _ = compute(store, model, "a", toks)
        store.retire(0, kv, cur)
        store.flush_saves(0, 10)
        warm = store.resolve_prefix_sync(0, "b", toks)  # device hit
        warm.hold.release()
        churn(store)
        cold = store.resolve_prefix_sync(0, "c", toks)  # host hit
        assert cold.host_tokens == 16
        cold.hold.release()
        got = scrape(address)
        name = cs.cluster.name
        counters = store.counters
        assert value(got, "kvproc:prefix_cache_queries_total", cluster=name) == counters["prefix_cache_queries"] == 3 * 17
        assert value(got, "kvproc:prefix_cache_hits_total", tier="device") == counters["prefix_cache_hits_device"] == 16
        assert value(got, "kvproc:prefix_cache_hits_total", tier="host") == counters["prefix_cache_hits_host"] == 16
        assert value(got, "kvproc:saves_total", outcome="ok", reason="") == store.outcomes.counts["save.ok"] >= 1
        assert value(got, "kvproc:resolves_total", outcome="ok", reason="") == store.outcomes.counts["resolve.ok"]
        for role in ("host_tier", "copy_worker"):
            assert value(got, "kvproc:process_up", role=role, rank="0") == 1.0
            assert value(got, "kvproc:process_restarts_total", role=role, rank="0") == 0.0
        worker = cs.cluster.client("copy_worker").request(m.Stats(), timeout=5).counters
        assert value(got, "kvproc:copy_bytes_total", direction="load") == worker["bytes_load"] > 0
        assert value(got, "kvproc:counter", role="copy_worker", rank="0", name="orders_save") == worker["orders_save"]
        # the console's counters of the store itself, under the launcher's process
        assert value(got, "kvproc:counter", role="launcher", name="store.prefix_cache_hits_host") == 16


def histogram(families: dict[str, list[Any]], metric: str, **labels: str) -> tuple[list[tuple[float, float]], float,
                                                                                     float]:
    """([(le, cumulative count)], _count, _sum) of one series of a histogram family."""
    samples = [s for s in families[metric] if all(s.labels.get(k) == v for k, v in labels.items())]
    buckets = sorted((float(s.labels["le"]), s.value) for s in samples if s.name == f"{metric}_bucket")
    (count,) = [s.value for s in samples if s.name == f"{metric}_count"]
    (total,) = [s.value for s in samples if s.name == f"{metric}_sum"]
    return buckets, count, total


def test_resolve_and_copy_latency_histograms_count_every_resolve_by_what_served_it_and_every_copy_order() -> None:
    with cluster_store(metrics="127.0.0.1:0") as (cs, store, model):
        toks = list(range(1, 18))
        t0 = time.perf_counter()
        kv, cur, _, _ = compute(store, model, "a", toks)  # a miss
        store.retire(0, kv, cur)
        store.flush_saves(0, 10)
        store.resolve_prefix_sync(0, "b", toks).hold.release()  # device hit, blocking form
        store.submit_resolve(0, "b2", toks).result(10).hold.release()  # device hit, thread form
        churn(store)
        store.resolve_prefix_sync(0, "c", toks).hold.release()  # host hit
        wall = time.perf_counter() - t0
        got = scrape(cs.cluster.metrics.address)
        metric = "kvproc:resolve_latency_seconds"
        for hit, n in (("miss", 1), ("device", 2), ("host", 1)):
            buckets, count, total = histogram(got, metric, cluster=cs.cluster.name, hit=hit)
            assert count == n, (hit, buckets)
            assert buckets[-1] == (float("inf"), n)
            assert [c for _, c in buckets] == sorted(c for _, c in buckets)  # cumulative
            assert len(buckets) == 18  # every standard bound, hit or not
            assert 0 < total < wall
        worker = cs.cluster.client("copy_worker").request(m.Stats(), timeout=5).counters
        for direction in ("save", "load"):
            _, count, total = histogram(got, "kvproc:copy_latency_seconds", direction=direction)
            assert count == worker[f"orders_{direction}"] >= 1
            assert total == pytest.approx(worker[f"ns_{direction}"] / 1e9)
        # the buckets are no console counters: not repeated under kvproc:counter
        assert not [s for s in got["kvproc:counter"] if s.labels["name"].startswith("hist.")]


def test_a_killed_child_is_reported_down_then_restarted() -> None:
    with cluster_store(metrics="127.0.0.1:0") as (cs, store, model):
        address = cs.cluster.metrics.address
        os.kill(cs.cluster.pid("copy_worker"), signal.SIGKILL)
        wait_for(lambda: value(scrape(address), "kvproc:process_restarts_total", role="copy_worker", rank="0") == 1,
                 timeout=30, what="the restart in /metrics")
        wait_for(lambda: value(scrape(address), "kvproc:process_up", role="copy_worker", rank="0") == 1,
                 timeout=30, what="the new incarnation up in /metrics")


def test_metrics_are_off_unless_asked() -> None:
    with cluster_store() as (cs, _, _):
        assert cs.cluster.metrics is None


def test_a_bad_or_taken_address_fails_before_any_child_starts(tmp_path: Any) -> None:
    before = descendants()
    with pytest.raises(ValueError, match="HOST:PORT"):
        launch([RoleConfig("host_tier")], cluster_name="mt", runtime_dir=str(tmp_path / "a"), metrics="nowhere")
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        with pytest.raises(OSError):
            launch([RoleConfig("host_tier")], cluster_name="mt", runtime_dir=str(tmp_path / "b"),
                   metrics=f"127.0.0.1:{taken.getsockname()[1]}")
    finally:
        taken.close()
    assert descendants() - before == set()


def _silent_connections(port: int, n: int) -> list[Any]:
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        out.append(s)
    return out


def _threads(prefix: str) -> int:
    import threading

    return sum(t.name.startswith(prefix) for t in threading.enumerate())


def test_slow_connections_take_a_bounded_pool_and_a_scrape_still_answers_after_them() -> None:
    """600 connections that send nothing (issue 39: 613 threads in the tier's process before): at most the pool's
    threads serve them, the rest are closed at once, and once they are gone a scrape is answered."""
    from kvproc.runtime import http_pool

    with cluster_store(metrics="127.0.0.1:0") as (cs, store, model):
        endpoint = cs.cluster.metrics
        port = int(endpoint.address.rsplit(":", 1)[1])
        conns = _silent_connections(port, 600)
        try:
            wait_for(lambda: endpoint._server.refused >= 600 - http_pool.WORKERS - http_pool.QUEUED, 10,
                     "the connections past the bound closed")
            assert _threads("kvproc-metrics") <= http_pool.WORKERS + 1  # the pool (+ the accept loop's thread)
        finally:
            for c in conns:
                c.close()
        got = {}
        for _ in range(50):  # the pool's workers see their clients close: free again at once
            try:
                got = scrape(endpoint.address)
                break
            except OSError:
                time.sleep(0.2)
        assert "kvproc:process_up" in got


def test_an_idle_connection_is_closed_after_the_timeout() -> None:
    from kvproc.runtime.http_pool import serve

    server, thread = serve(lambda env, start: [start("200 OK", []) or b""], "127.0.0.1", 0, timeout_s=0.3)
    try:
        (conn,) = _silent_connections(server.server_port, 1)
        conn.settimeout(5)
        t0 = time.monotonic()
        assert conn.recv(1) == b""  # the server hung up on a client that sent nothing
        assert time.monotonic() - t0 < 4
        conn.close()
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_control_prometheus_clients_own_server_starts_a_thread_per_connection() -> None:
    """Why the pool: the server this endpoint used before serves each of 200 silent connections on a thread."""
    import threading

    from prometheus_client import CollectorRegistry, start_http_server

    server, thread = start_http_server(0, addr="127.0.0.1", registry=CollectorRegistry())
    before = threading.active_count()
    conns: list[Any] = []
    try:
        # One connection at a time, each waited for on a thread of its own: opened all at once, they overflow the
        # server's 5-deep listen backlog and the kernel's SYN retries took ~22 s of this test's 27.
        for i in range(1, 201):
            conns += _silent_connections(server.server_port, 1)
            wait_for(lambda: threading.active_count() - before >= i, 10, f"a thread for connection {i}")
    finally:
        for c in conns:
            c.close()
        server.shutdown()
        server.server_close()
        thread.join(5)
