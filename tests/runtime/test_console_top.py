"""`kvproc console top` against a running cluster with a store: a few frames of rates (not totals), occupancy and
per-process CPU/RSS, in JSON and as the text view."""

from __future__ import annotations

import json
import threading
from typing import Any

from kvproc.runtime import console
from tests.conftest import churn, cluster_store, compute


def _frames(capsys: Any, runtime_dir: str, n: int, *extra: str) -> list[dict[str, Any]]:
    capsys.readouterr()
    assert console.main(["top", "--runtime-dir", runtime_dir, "--frames", str(n), "--interval", "0.5", "--json",
                         *extra]) == 0
    # The cluster runs in this process too: its log lines (console-rendered, not JSON) may share the captured stdout.
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert len(lines) == n
    return [json.loads(line) for line in lines]


def test_top_shows_rates_while_a_workload_runs_and_zero_rates_once_it_stops(capsys: Any) -> None:
    with cluster_store() as (cs, store, model):
        toks = list(range(1, 18))
        kv, cur, _, _ = compute(store, model, "seed", toks)
        store.retire(0, kv, cur)
        store.flush_saves(0, 10)
        stop = threading.Event()
        resolved = [0]

        def workload() -> None:  # host hits, one after another, for as long as the frames take
            while not stop.is_set():
                churn(store)
                store.resolve_prefix_sync(0, f"r{resolved[0]}", toks).hold.release()
                resolved[0] += 1

        t = threading.Thread(target=workload)
        t.start()
        try:
            busy = _frames(capsys, cs.cluster.runtime_dir, 2)
        finally:
            stop.set()
            t.join(30)
        assert resolved[0] > 0
        for f in busy:
            assert 0.4 <= f["interval_s"] < 30
            assert f["resolves_per_s"] > 0
            assert f["hit_ratio"]["host"] > 0 and f["hit_ratio"]["device"] == 0  # churned before every resolve
            assert f["copy_gb_per_s"]["load"] > 0 and f["copy_gb_per_s"]["save"] == 0
            (pool,) = f["pools"]
            assert pool["rank"] == 0 and pool["blocks"] == 32
            (tier,) = f["tiers"]
            assert tier["slots"] > 0 and tier["used"] >= 1 and 0 < tier["occupancy"] <= 1
            assert f["open_leases"] >= 0 and f["saves_shed_per_s"] == 0
            roles = {(p["role"], p["rank"]) for p in f["processes"]}
            assert roles == {("launcher", 0), ("host_tier", 0), ("copy_worker", 0)}
            assert all(p["rss_mib"] > 0 and p["cpu_pct"] is not None for p in f["processes"])
        # the same cluster idle: its totals are unchanged and non-zero, its rates are zero
        (idle,) = _frames(capsys, cs.cluster.runtime_dir, 1)
        assert idle["resolves_per_s"] == 0 and idle["copy_gb_per_s"] == {"save": 0, "load": 0}
        assert idle["hit_ratio"] == {"device": None, "host": None, "miss": None}
        assert store.counters["prefix_cache_hits_host"] > 0
        # the text view, frames one after the other when not on a terminal (no escape codes)
        capsys.readouterr()
        assert console.main(["top", "--runtime-dir", cs.cluster.runtime_dir, "--frames", "1", "--interval",
                             "0.2"]) == 0
        text = capsys.readouterr().out
        for needle in ("resolves/s", "hit ratio", "copy GB/s", "leases open", "pool rank0", "tier rank0",
                       "copy_worker", "host_tier", "CPU%", "RSS_MiB"):
            assert needle in text, needle
        assert "\x1b" not in text
