"""`kvproc bench ipc --observe-toggle R`: what /metrics and KV events cost a host-hit resolve, A/B within one run
and one process, the observation switched on and off every round.

Why not `--observe-ab` (a fresh process and cluster per arm): on a shared 2-vCPU machine two clusters started a
second apart differ by +-30% between themselves (bench/RESULTS.md, "Observability overhead"), ten times the 2% the
issue asks to resolve. Here everything is started once, fully observed -- `ClusterStore.start(metrics=...,
kv_events=True, device_kv_events=True)`, `kvproc/bench/observer.py` in a process of its own scraping /metrics every
`--scrape-s` and reading every host-tier and device-pool event batch -- and the rounds alternate (on, off, off, on,
...) so that a slow or fast moment of the machine falls on both arms:

- `on`: rank 0's device pool publishes its index changes (read by the observer), and the observer scrapes /metrics
  once per `--scrape-s` of the on rounds' timed time: the bench asks for each scrape at the start of a round's timed
  resolves, so every scrape lands on timed resolves, at the asked rate and no faster;
- `off`: the device pool has no listener (what `device_kv_events=False` runs) and nobody scrapes. The /metrics
  endpoint stays bound, idle: a listening socket nobody connects to costs nothing. A host-hit resolve makes no
  host-tier event (the tier publishes what saves commit), so both arms have the tier's publisher idle while timed.

Each round sets its arm, seals its own `--n` fresh prompts (untimed), flushes the device pool's publisher, waits
`SETTLE_S` (the host tier's batch of those seals goes out and is read), then times `--n` blocking host-hit resolves (`IpcBench.resolve`: the device pool churned before each, so each resolve
registers its restored pages and each churn removes some: two device events per resolve). The figures: the
geometric mean over the round pairs of on / off, for the rounds' median resolve (robust to a stray slow resolve) and
for their mean resolve (every resolve counts, a scrape's hiccup too), each with a 95% bootstrap interval over the
pairs. A pair's rounds ran within milliseconds of each other, so the machine's slower and faster minutes cancel.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
import time
from typing import Any

# The observer stands in for a Prometheus server and a router, which run on other machines: at nice 19 it takes only
# the CPU kvproc's processes leave on this 2-vCPU box, so its own reading and parsing is not charged to kvproc (what
# kvproc does for it -- answering the scrape, encoding and sending the batches -- is in the on arm).
OBSERVER_NICE = 19
SETTLE_S = 0.1  # after a round's seals: the host tier's publisher sends their batch (50 ms) and the observer reads it


def geomean_ci(ratios: list[float], reps: int = 4000, seed: int = 1) -> tuple[float, float, float]:
    """(geometric mean of `ratios`, and its 2.5th and 97.5th percentiles over `reps` bootstrap resamples)."""
    logs = [math.log(x) for x in ratios]
    rng = random.Random(seed)
    boot = sorted(math.exp(statistics.fmean(rng.choices(logs, k=len(logs)))) for _ in range(reps))
    return math.exp(statistics.fmean(logs)), boot[int(0.025 * reps)], boot[int(0.975 * reps) - 1]


def median_ci(ratios: list[float], reps: int = 4000, seed: int = 2) -> tuple[float, float, float]:
    """(median of `ratios`, and its 2.5th and 97.5th percentiles over `reps` bootstrap resamples)."""
    rng = random.Random(seed)
    boot = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(reps))
    return statistics.median(ratios), boot[int(0.025 * reps)], boot[int(0.975 * reps) - 1]


def main(rounds: int, n: int, blocks: int, scrape_s: float, json_path: str | None, toggled: str = "all",
         alternate: str = "round") -> int:
    """`toggled`: what the on arm switches on: "all", "events" (device-pool events only: no scrape), "metrics"
    (the scrapes only: no device-pool listener) or "none" (the A/A control: the arms differ in nothing, so what it
    prints is the harness's own bias and noise).

    `alternate` "resolve": the arms alternate every resolve within each round (ABBA over the round's resolves, its
    phase turned by one each round), and each round is one pair: its on resolves' median over its off resolves'.
    A pair's two arms then ran interleaved within the same ~10 ms, so the machine's moments cancel even where two
    rounds 150 ms apart differ by several percent (an A/A at round level read +-5% on a noisy day). It toggles the
    device-pool events only (`toggled` "events" or "none"): a scrape cannot be given to one resolve. The publisher's
    thread then builds, encodes and sends at its ticks whichever arm is running: its CPU time (`busy_s`) is printed
    per on-resolve beside the A/B, the part of the cost that the interleaving spreads over both arms. Printed too:
    that thread's whole CPU time (its wakes and takes as well, from /proc) per on-resolve."""
    per_resolve = alternate == "resolve"
    if per_resolve and toggled not in ("events", "none"):
        raise ValueError("alternating every resolve toggles the device-pool events only: --toggled events or none")
    from kvproc.bench.ipcbench import ARENA_BLOCK, CONCURRENCY, IpcBench, IpcBenchModel, Observer
    from kvproc.store.cluster import ClusterStore
    from kvproc.store.types import StoreConfig

    # The host tier holds a few rounds' prompts: a round resolves only what it sealed, older pages may be evicted.
    host_bytes = (4 * n + 64) * blocks * 2 * ARENA_BLOCK + (4 << 20)
    cs = ClusterStore.start(host_bytes, metrics="127.0.0.1:0", kv_events=True, device_kv_events=True)
    observer: Observer | None = None
    next_scrape, scrapes = 0.0, 0
    per_round: dict[str, list[float]] = {"on": [], "off": []}  # each round's mean resolve
    per_round_med: dict[str, list[float]] = {"on": [], "off": []}  # each round's median resolve
    samples: dict[str, list[float]] = {"on": [], "off": []}
    on_seconds = 0.0
    warm_events = 0
    thread_cpu = 0.0  # the device publisher thread's CPU over the timed rounds
    busy = 0.0  # and its `busy_s` over the same rounds (not the warm-up's: compared with `thread_cpu`)
    try:
        model = IpcBenchModel(cs.allocator, 2048)
        store = cs.attach_model(model, live_slots=CONCURRENCY, config=StoreConfig(cacheable_pin_fraction=1.0))
        assert cs.device_events is not None
        pub = cs.device_events.publishers[0]
        pool = store.pools[0]
        listener = pool.paged.listener
        observer = Observer(cs, 0, device=True, nice=OBSERVER_NICE)  # 0: scrapes when asked
        b = IpcBench(cs, store, model, record_orders=False)
        try:
            for p in [b.prompt(blocks) for _ in range(10)]:  # warm: the first resolves of a cluster are slower
                b.seal(p)
                b.resolve(p, blocks)
            assert pub.flush(), "the device-pool publisher did not drain"
            warm_events = pub.events  # the rounds' events are the ones after these
            thread_cpu0, busy0 = thread_cpu_s(pub), pub.busy_s
            order = ("on", "off", "off", "on")  # ABBA: a drift within a block of four rounds falls on both arms
            for r in range(rounds):
                if r % 10 == 0 and sys.stderr.isatty():
                    print(f"\r  observe toggle: round {r}/{rounds}", end="", file=sys.stderr, flush=True)
                if per_resolve:
                    _round_per_resolve(b, pool, listener if toggled == "events" else None, blocks, n, r, order,
                                       per_round, per_round_med, samples)
                    continue
                arm = order[r % 4]
                # The arm is set before the round's (untimed) seals: the observer reads the host tier's batch of
                # those seals during the settle, not during the timing.
                with pool.lock:
                    pool.paged.listener = listener if arm == "on" and toggled in ("all", "events") else None
                prompts = [b.prompt(blocks) for _ in range(n)]
                for p in prompts:
                    b.seal(p)
                assert pub.flush(), "the device-pool publisher did not drain"
                time.sleep(SETTLE_S)
                scrape = arm == "on" and toggled in ("all", "metrics") and on_seconds >= next_scrape
                if scrape:
                    observer.scrape_start()
                    next_scrape += scrape_s
                t0 = time.perf_counter()
                times = [b.resolve(p, blocks) for p in prompts]
                if arm == "on":
                    on_seconds += time.perf_counter() - t0
                if scrape:
                    observer.scrape_done()
                    scrapes += 1
                samples[arm] += times
                per_round[arm].append(statistics.fmean(times))
                per_round_med[arm].append(statistics.median(times))
            thread_cpu, busy = thread_cpu_s(pub) - thread_cpu0, pub.busy_s - busy0
        finally:
            b.close()
            with pool.lock:
                pool.paged.listener = listener
    finally:
        seen: dict[str, int] = {}
        if observer is not None:
            seen = observer.close()
        cs.close()
    # The rounds in the order they ran, paired (on, off) within each block of four: (r0, r1) and (r3, r2).
    k = min(len(per_round["on"]), len(per_round["off"]))
    pair_ratios = [a / b_ for a, b_ in zip(per_round_med["on"][:k], per_round_med["off"][:k])]
    med_ratio, med_lo, med_hi = geomean_ci(pair_ratios)
    mean_ratio, mean_lo, mean_hi = geomean_ci([a / b_ for a, b_ in zip(per_round["on"][:k], per_round["off"][:k])])
    med_on, med_off = statistics.median(samples["on"]), statistics.median(samples["off"])
    print(f"# toggled: {toggled}; observability toggled within one run: {k} round pairs (ABBA), {n} blocking host-hit resolves of {blocks}"
          f" blocks per round; on = device-pool events + host-tier events + /metrics scraped every {scrape_s:g} s "
          f"of timed resolves and every batch read, by a third process at nice {OBSERVER_NICE}; off = no device-pool listener, no scrape")
    pmed = median_ci(pair_ratios)
    for label, (x, lo, hi) in (("rounds' median resolve, geometric mean", (med_ratio, med_lo, med_hi)),
                               ("rounds' median resolve, median pair", pmed),
                               ("rounds' mean resolve, geometric mean", (mean_ratio, mean_lo, mean_hi))):
        print(f"{label}, on / off: {x:.4f} ({100 * (x - 1):+.2f}%), 95% bootstrap interval over the pairs "
              f"{100 * (lo - 1):+.2f}% to {100 * (hi - 1):+.2f}%")
    print(f"{sum(x > 1 for x in pair_ratios)} of {k} pairs' median ratios above 1; every resolve's median: on "
          f"{med_on * 1e6:.0f} us, off {med_off * 1e6:.0f} us ({100 * (med_on / med_off - 1):+.2f}%)")
    print(f"observer: {scrapes} scrapes in {on_seconds:.1f} s of 'on' rounds, {seen.get('kv_event_batches_read', 0)} "
          f"event batches read; device publisher: {pub.batches} batches, {pub.events} events")
    on_resolves = len(samples["on"])
    if pub.events and on_resolves:
        busy_us = busy * 1e6 / on_resolves
        print(f"device publisher's thread: {busy * 1e3:.0f} ms of CPU building, "
              f"encoding and sending, {busy_us:.2f} us per 'on' resolve ({100 * busy_us / (med_on * 1e6):.2f}% of "
              f"its median): "
              f"not timed by a resolve unless it held the GIL or a core one needed")
        print(f"the thread's whole CPU time (its wakes and takes too, /proc schedstat): {thread_cpu * 1e3:.0f} ms, "
              f"{thread_cpu * 1e6 / on_resolves:.2f} us per 'on' resolve")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({"rounds": rounds, "n": n, "blocks": blocks, "scrape_s": scrape_s,
                       "median_ratio": [med_ratio, med_lo, med_hi], "median_pair": list(pmed), "mean_ratio": [mean_ratio, mean_lo, mean_hi],
                       "pair_ratios": pair_ratios, "per_round_mean": per_round, "per_round_median": per_round_med, "median_on_us": med_on * 1e6, "median_off_us": med_off * 1e6,
                       "observer": seen, "on_seconds": on_seconds, "scrapes": scrapes,
                       "device_batches": pub.batches, "alternate": alternate, "toggled": toggled,
                       "publisher_busy_s": busy, "publisher_thread_cpu_s": thread_cpu, "device_events": pub.events - warm_events}, f, indent=2)
    return 0


def thread_cpu_s(pub: Any) -> float:
    """The publisher's thread's CPU time so far, everything it ran (`busy_s` times only its batches' encode, keep and
    send): the first field of its /proc schedstat, on Linux; 0.0 elsewhere."""
    try:
        with open(f"/proc/self/task/{pub._threads[0].native_id}/schedstat") as f:
            return int(f.read().split()[0]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0


def _round_per_resolve(b: Any, pool: Any, listener: Any, blocks: int, n: int, r: int, order: tuple[str, ...],
                       per_round: dict[str, list[float]], per_round_med: dict[str, list[float]],
                       samples: dict[str, list[float]]) -> None:
    """One round of `alternate` "resolve": seal `n` prompts (untimed), then time their resolves with the device
    pool's listener set (`listener`; None for the A/A) or not, in ABBA order from phase `r`."""
    with pool.lock:  # the seals make no device event: the publisher's thread has only the on resolves' to send
        pool.paged.listener = None
    prompts = [b.prompt(blocks) for _ in range(n)]
    for p in prompts:
        b.seal(p)
    time.sleep(SETTLE_S)
    times: dict[str, list[float]] = {"on": [], "off": []}
    for i, p in enumerate(prompts):
        arm = order[(i + r) % 4]
        with pool.lock:
            pool.paged.listener = listener if arm == "on" else None
        times[arm].append(b.resolve(p, blocks))
    for arm in ("on", "off"):
        samples[arm] += times[arm]
        per_round[arm].append(statistics.fmean(times[arm]))
        per_round_med[arm].append(statistics.median(times[arm]))


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), 16, 1.0, None))
