"""`/metrics` scraped while the demo's workload runs (issue 21): the cluster is found through its manifest alone, the
hit counters only grow while the turns complete, and at the end they are the demo's own table (prompt tokens, from
device, from host)."""

from __future__ import annotations

import glob
import itertools
import os
import threading
import time
from typing import Any

from kvproc.demo.single import _parser, format_table, run_one, workload
from kvproc.engine.topology import Topology
from kvproc.runtime import manifest as mf
from tests.runtime.test_metrics import scrape, value

ARGS = ["--model", "dense", "--scale", "0.1", "--conversations", "8", "--turns", "3", "--concurrency", "4",
        "--runs", "kvproc", "--metrics", "127.0.0.1:0", "--no-progress"]


def _our_metrics() -> tuple[str, str] | None:
    """(cluster, /metrics address) of a cluster this process launched, read from the manifests on this node."""
    base = os.path.dirname(mf.default_runtime_dir("x"))
    for path in glob.glob(os.path.join(base, "*", "manifest.json")):
        try:
            found = mf.read_manifest(os.path.dirname(path))
        except (OSError, ValueError):
            continue  # being rewritten, or another cluster's going away
        if found.launcher_pid == os.getpid() and found.metrics:
            return found.cluster, found.metrics
    return None


def _hits(address: str, cluster: str) -> tuple[float, float, float]:
    got = scrape(address)
    return (value(got, "kvproc:prefix_cache_queries_total", cluster=cluster),
            value(got, "kvproc:prefix_cache_hits_total", cluster=cluster, tier="device"),
            value(got, "kvproc:prefix_cache_hits_total", cluster=cluster, tier="host"))


def test_metrics_scraped_during_the_demo_agree_with_its_table() -> None:
    args = _parser().parse_args(ARGS)
    spec, sizes = workload(args)
    during: list[tuple[float, float, float]] = []
    stop = threading.Event()

    def scraper() -> None:  # an outside observer: it knows only that the cluster is on this node
        found = None
        while not stop.is_set():
            found = found or _our_metrics()
            if found is not None:
                try:
                    during.append(_hits(found[1], found[0]))
                except OSError:  # the run's cluster is shutting down
                    pass
                except AssertionError:  # no store counters yet: the cluster is up, the model not yet attached
                    pass
            time.sleep(0.2)

    final: dict[str, Any] = {}

    def after(topo: Topology) -> None:  # the workload is done, the cluster still up: the last scrape
        found = _our_metrics()
        assert found is not None and found[1] == topo.metrics_address
        final["hits"] = _hits(found[1], found[0])

    t = threading.Thread(target=scraper)
    t.start()
    try:
        summary, _, stats = run_one("kvproc", args, spec, sizes, None, after=after)
    finally:
        stop.set()
        t.join(30)
    assert summary.turns_completed == spec.total_turns and summary.turns_failed == 0
    queries, device, host = final["hits"]
    # the demo's own table, as printed
    row = format_table({"kvproc": summary}).splitlines()[2].split()
    prompt_tok, from_device, from_host = (int(x.replace(",", "")) for x in row[5:8])
    assert (prompt_tok, from_device, from_host) == (summary.prompt_tokens, summary.device_hit_tokens,
                                                    summary.host_hit_tokens)
    assert from_device > 0 and from_host > 0  # the workload reuses both tiers
    engine = stats["engine"]
    if engine.get("holds_released_for_admission", 0) or engine.get("restore_failed_recomputed", 0):
        # a request resolved again (admission unblocked, or a failed restore): the store counts every resolve,
        # the table the one its turn was admitted with
        assert queries >= prompt_tok and device + host >= from_device + from_host
    else:
        assert (queries, device, host) == (prompt_tok, from_device, from_host)
    # scraped during the run: seen part-way, never going backwards, never past the end
    assert during, "no scrape while the workload ran"
    assert any(0 < q < queries for q, _, _ in during), during
    for earlier, later in itertools.pairwise(during):
        assert all(a <= b for a, b in zip(earlier, later)), (earlier, later)
    assert all(q <= queries and d <= device and h <= host for q, d, h in during)
