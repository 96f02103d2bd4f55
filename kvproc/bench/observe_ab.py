"""`kvproc bench ipc --observe-ab N`: what observability costs a host-hit resolve, as an A/B in one run.

Each arm is a process of its own, with its own cluster: `plain` (no /metrics endpoint, no KV-event publisher: the
default, where neither exists) and `observed` (`ClusterStore.start(metrics=..., kv_events=True)`, with
`kvproc/bench/observer.py` in a third process scraping /metrics every `--scrape-s` and reading every event batch,
as a Prometheus server and a router would). A process per arm, because a second cluster in the same process would
share the store's GIL with the first one's scrapes. N pairs, the arms' order alternating (plain first, then observed
first), so a slow or fast moment of a shared machine falls on both; the figure is the median over the pairs of
observed / plain, for the median blocking host-hit resolve (`IpcBench.resolve`, the device pool churned before each)
and the median seal (retire until saved: where a tier publishes its events). The mean resolve is given too (it
carries the resolves a scrape landed on).

The always-on part -- the store's counters and latency histograms -- is in both arms; its own cost (one resolve's
histogram observation) is timed in-process and printed beside.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from typing import Any

ARMS = ("plain", "observed")


def run_arm(observed: bool, n: int, blocks: int, scrape_s: float, device_events: bool = False) -> dict[str, Any]:
    """One arm in this process: a fresh cluster, `n` seals timed, then `n` host-hit resolves timed. `device_events`:
    the observed arm also publishes rank 0's device-pool events (`device_kv_events=True`), read by the observer."""
    from kvproc.bench.ipcbench import ARENA_BLOCK, CONCURRENCY, IpcBench, IpcBenchModel, Observer
    from kvproc.store.cluster import ClusterStore
    from kvproc.store.types import StoreConfig

    warm = 10
    host_bytes = (2 * n + warm + 64) * blocks * 2 * ARENA_BLOCK + (4 << 20)
    cs = ClusterStore.start(host_bytes, metrics="127.0.0.1:0" if observed else None, kv_events=observed,
                            device_kv_events=observed and device_events)
    observer: Observer | None = None
    t0 = time.perf_counter()
    try:
        model = IpcBenchModel(cs.allocator, 2048)
        store = cs.attach_model(model, live_slots=CONCURRENCY, config=StoreConfig(cacheable_pin_fraction=1.0))
        # After attach_model: the device pools' publishers (when on) exist, and the observer subscribes to them too.
        observer = Observer(cs, scrape_s, device=observed and device_events) if observed else None
        b = IpcBench(cs, store, model, record_orders=False)
        try:
            seal_s = [b.seal(b.prompt(blocks)) for _ in range(n + warm)][warm:]
            prompts = [b.prompt(blocks) for _ in range(n + warm)]
            for p in prompts:
                b.seal(p)
            resolve_s = [b.resolve(p, blocks) for p in prompts][warm:]
        finally:
            b.close()
    finally:
        seen = observer.close() if observer is not None else {}
        wall = time.perf_counter() - t0
        device_batches = sum(p.batches for p in cs.device_events.publishers) if cs.device_events is not None else 0
        cs.close()
    return {"arm": "observed" if observed else "plain", "resolve_median_us": statistics.median(resolve_s) * 1e6,
            "resolve_mean_us": statistics.fmean(resolve_s) * 1e6, "seal_median_us": statistics.median(seal_s) * 1e6,
            "seconds": round(wall, 1), "device_event_batches": device_batches, **seen}


def histogram_cost_ns(reps: int = 200_000) -> float:
    """One resolve's latency observation (`KvStore._observe_resolve`'s work: bisect + two counter bumps under a
    lock), in ns."""
    import collections
    import threading

    from kvproc.runtime.histogram import Histogram

    h, counters, lock = Histogram("resolve_latency_seconds", "host"), collections.Counter[str](), threading.Lock()
    t = time.perf_counter_ns()
    for i in range(reps):
        pairs = h.keys(300_000 + i)
        with lock:
            for name, k in pairs:
                counters[name] += k
    return (time.perf_counter_ns() - t) / reps


def _child(arm: str, n: int, blocks: int, scrape_s: float, device_events: bool) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "kvproc.bench.observe_ab", "--child", arm, "--n", str(n),
                          "--blocks", str(blocks), "--scrape-s", str(scrape_s)]
                         + (["--device-events"] if device_events else []),
                         capture_output=True, text=True, timeout=600, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"arm {arm} failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main(pairs: int, n: int, blocks: int, scrape_s: float, json_path: str | None, device_events: bool = False) -> int:
    rows: list[dict[str, Any]] = []
    for i in range(pairs):
        order = ARMS if i % 2 == 0 else ARMS[::-1]
        got = {}
        for arm in order:
            print(f"  observe A/B: pair {i + 1}/{pairs}, {arm} ...", file=sys.stderr, flush=True)
            got[arm] = _child(arm, n, blocks, scrape_s, device_events)
        rows.append({"first": order[0], **{f"{a}_{k}": v for a in ARMS for k, v in got[a].items() if k != "arm"}})
    ratio = {k: [r[f"observed_{k}"] / r[f"plain_{k}"] for r in rows]
             for k in ("resolve_median_us", "resolve_mean_us", "seal_median_us")}
    hist_ns = histogram_cost_ns()
    plain_us = statistics.median(r["plain_resolve_median_us"] for r in rows)
    print(f"# observability A/B, {pairs} pairs (arms alternating which goes first), {n} host-hit resolves of {blocks} "
          f"blocks and {n} seals per arm, each arm its own process and cluster; observed: /metrics scraped every "
          f"{scrape_s:g} s and every KV event batch read, by a third process"
          + ("; device-pool events on (device_kv_events=True)" if device_events else "; host-tier events only"))
    print("| pair | first | plain resolve (us, median / mean) | observed resolve (us, median / mean) | ratio (median) "
          "| plain seal (us) | observed seal (us) | scrapes | event batches read |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rows):
        print(f"| {i + 1} | {r['first']} | {r['plain_resolve_median_us']:.0f} / {r['plain_resolve_mean_us']:.0f} | "
              f"{r['observed_resolve_median_us']:.0f} / {r['observed_resolve_mean_us']:.0f} | "
              f"{ratio['resolve_median_us'][i]:.3f} | {r['plain_seal_median_us']:.0f} | "
              f"{r['observed_seal_median_us']:.0f} | {r.get('observed_metrics_scrapes', 0)} | "
              f"{r.get('observed_kv_event_batches_read', 0)} |")
    med = {k: statistics.median(v) for k, v in ratio.items()}
    print(f"median over the pairs of observed / plain: resolve (median) {med['resolve_median_us']:.3f} "
          f"({100 * (med['resolve_median_us'] - 1):+.1f}%), resolve (mean) {med['resolve_mean_us']:.3f} "
          f"({100 * (med['resolve_mean_us'] - 1):+.1f}%), seal {med['seal_median_us']:.3f} "
          f"({100 * (med['seal_median_us'] - 1):+.1f}%)")
    print(f"always on, both arms: one resolve's latency-histogram observation {hist_ns:.0f} ns "
          f"({100 * hist_ns / 1e3 / plain_us:.2f}% of the plain median resolve, {plain_us:.0f} us)")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"pairs": rows, "median_ratio": med, "histogram_observe_ns": hist_ns, "n": n, "blocks": blocks,
                       "scrape_s": scrape_s, "device_events": device_events}, f, indent=2)
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(prog="python -m kvproc.bench.observe_ab")
    ap.add_argument("--child", choices=ARMS, required=True)
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--blocks", type=int, default=16)
    ap.add_argument("--scrape-s", type=float, default=1.0)
    ap.add_argument("--device-events", action="store_true")
    a = ap.parse_args()
    print(json.dumps(run_arm(a.child == "observed", a.n, a.blocks, a.scrape_s, a.device_events)), flush=True)
