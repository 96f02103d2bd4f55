"""`kvproc bench ipc`: the control path's cost in round trips. A host-hit `resolve_prefix` and a seal/retire of 1, 16,
64 and 256 blocks through a real `ClusterStore` (host tier and copy worker processes), against a raw pyzmq
DEALER/ROUTER round trip measured in the same run.

- raw: 64 B DEALER send + recv against a ROUTER echo loop in its own process (the transport's floor);
- resolve: `submit_resolve(...).result()` of a prompt whose pages are on the host tier only (the device pool is
  churned before each one, outside the timing): the store's one resolve, on its event loop (Query, Load, the release);
- copy: each resolve's Load as the copy worker timed it executing the order (`Copied.ns`: the bytes' cost where and
  when they moved -- a host hit's pages were written long before, so they come from memory more than cache); beside
  it, the very Load orders the store sent replayed in this process by a `CopyExecutor` over the same segments right
  after (warm: the worker has just read those bytes into the shared cache; stops 9-11 subtracted this one) and the
  worker's mean over every arm;
- raw2: two raw round trips (the messages a host hit needs: Query, Load) timed after the same churn, interleaved with
  the resolves: the baseline under the same cache state and the same moment of a noisy shared host;
- burst: resolves back to back (one churn per 6, the first dropped), against raw2_burst (raw pairs back to back): the
  case of an engine admitting several requests in a row;
- overhead, in raw round trips: `beyond needed` = median over the resolves of (resolve - its own Load's copy in situ)
  less 2 x rtt (rtt = raw2 / 2), over rtt; `with the replayed copy` = the same with the warm replay subtracted
  instead; `total` = (resolve - copy) / the hot raw round trip. Resolves that made more than one Load are left out of
  the medians and counted.
(The store once had faster forms of the resolve -- on threads of its own, and loads started or verified before the
tier's answer -- that this bench compared; the end-to-end demo did not need them, and they were removed: bench/
RESULTS.md, "Control path".)
- seal: `retire` of a request with fresh pages until its save has landed (`flush_saves`): ReserveSave, Save order,
  commit; overhead (seal - copy) / raw against the in-process Save copy.
- resolves/s: 16 threads resolving distinct host-resident prompts of 16 blocks concurrently.
- `--observe-ab N`: only the cost of /metrics and KV events, plain vs observed in N interleaved pairs of runs
  (`kvproc/bench/observe_ab.py`).
- `--observe-toggle R`: the same cost within one run and one cluster, switched on and off every round for R rounds
  (`kvproc/bench/observe_toggle.py`; `--toggled` picks the part, `none` is the A/A control).
- `--ab-native N`: host-hit resolves of 16/64/256 blocks with the store side's compiled helpers
  (`kvproc.native._native`: hash chain, pool book-keeping) on vs off, interleaved batches of 5 (N x 10 each).
Medians. A page is 2 arenas x 2 KiB (4 KiB per block, 16 tokens).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

import msgspec
import torch
import zmq

from kvproc import native
from kvproc.contract import ArenaId, GroupKind, GroupSpec, KvArena, KvSpec, RepackDirection
from kvproc.core.request_kv import RequestKv
from kvproc.ipc.segment import Segment
from kvproc.runtime import procutil
from kvproc.store.cluster import ClusterStore
from kvproc.store.kv_store import KvStore
from kvproc.store.types import SealCursor, StoreConfig
from kvproc.workers.copy_exec import CopyExecutor

PAGE = 16
PROMPT_BASES = 2_146_435_069  # a prime, 2**20 + 2 below 2**31 - 1: room for a prompt of 2**20 tokens after it
ARENA_BLOCK = 2048
CONCURRENCY = 16
# Interleaved arms per size: resolves after a pool churn each (caches trashed, as after an engine step), raw2 (two raw
# round trips after the same churn), burst (resolves back to back) and raw2_burst.
ARMS = ("resolve", "raw2", "burst", "raw2_burst")
RESOLVE_ARMS = (("resolve", "raw2"), ("burst", "raw2_burst"))  # (arm, its raw baseline: two round trips)
PROMPTS_PER_BATCH = 2 * (5 + 6)  # resolves the arms use per batch (two orders per batch)

RAW_ECHO = """
import sys, zmq
s = zmq.Context.instance().socket(zmq.ROUTER)
s.setsockopt(zmq.LINGER, 0)
s.bind(sys.argv[1])
print("ready", flush=True)
while True:
    frames = s.recv_multipart()
    if frames[1] == b"stop":
        break
    s.send_multipart(frames)
"""


class IpcBenchModel:
    """One paged group of two arenas (like two layers), allocated in the ClusterStore's shared memory."""

    def __init__(self, allocator: Callable[[str, int], torch.Tensor], num_blocks: int) -> None:
        self._spec = KvSpec(PAGE, (GroupSpec("kv", GroupKind.PAGED),), model_id="kvproc-bench-ipc")
        self._arenas = [("kv", KvArena(f"kv{i}", allocator(f"kv{i}", num_blocks * ARENA_BLOCK), num_blocks,
                                       ARENA_BLOCK, ARENA_BLOCK)) for i in range(2)]

    def spec(self) -> KvSpec:
        return self._spec

    def arenas(self, rank: int) -> list[tuple[str, KvArena]]:
        return list(self._arenas)

    def repack(self, group: str, direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor,
               arena: ArenaId) -> None:
        dst.copy_(src)


def _median_us(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6


class _RawEcho:
    """The transport's floor: a raw pyzmq DEALER against a ROUTER echo loop in its own process (64 B frames). With
    `cpus`, the echo process runs there (the same CPUs as kvproc's processes in that run: the baseline's peer gets the
    worker's placement)."""

    def __init__(self, cpus: tuple[int, ...] | None = None) -> None:
        self._tmp = tempfile.mkdtemp(prefix="kvb-", dir="/tmp")
        ep = f"ipc://{self._tmp}/raw.sock"
        pin = (lambda: procutil.pin_cpus(cpus)) if cpus else None  # in the child, before it execs
        self._server = subprocess.Popen([sys.executable, "-c", RAW_ECHO, ep], stdout=subprocess.PIPE, text=True,
                                        preexec_fn=pin)
        assert self._server.stdout is not None and self._server.stdout.readline().strip() == "ready"
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(ep)
        self._data = b"x" * 64

    def round_trips(self, k: int = 1) -> float:
        """Seconds for `k` back-to-back round trips."""
        sock, data = self._sock, self._data
        t = time.perf_counter()
        for _ in range(k):
            sock.send(data)
            sock.recv()
        return time.perf_counter() - t

    def hot_median_us(self, n: int) -> float:
        """Median of `n` round trips in a tight loop (after a warm-up): the classic figure."""
        for _ in range(max(50, n // 10)):
            self.round_trips()
        return _median_us([self.round_trips() for _ in range(n)])

    def stop(self) -> None:
        self._sock.send(b"stop")
        self._sock.close()
        self._server.wait(5)
        shutil.rmtree(self._tmp, ignore_errors=True)


class IpcBench:
    def __init__(self, cs: ClusterStore, store: KvStore, model: IpcBenchModel, record_orders: bool = True) -> None:
        """`record_orders`: keep every copy order the store sends (`orders`, what `copy_times` replays); False for
        a harness that never replays them (an `--observe-toggle` run would keep ~2 MB of them a second)."""
        self.cs, self.store, self.model = cs, store, model
        self.pool = store.pools[0]
        self._next = 0
        self._rid = 0
        self.resolved: Counter[str] = Counter()  # per arm: resolves
        # per arm: each kept resolve's time less its own Load's copy time on the worker's clock (`Copied.ns`), and
        # that copy time; resolves that did not make exactly one Load are not in these lists
        self.net: dict[str, list[float]] = {}
        self.copy_in_situ: dict[str, list[float]] = {}
        assert cs.host_layout is not None
        self._host_seg = Segment.attach(cs.host_segment)
        self.local = CopyExecutor(store.layouts[0], self._host_seg.numpy(), cs.host_layout, threads=2)
        # The orders the store really sent (their ids may not coalesce): the copy baseline replays exactly these.
        self.orders: dict[str, list[Any]] = {"load": [], "save": []}
        if not record_orders:
            return
        copier: Any = store.copiers[0]
        for kind in ("load", "save"):
            setattr(copier, kind, self._recording(getattr(copier, kind), self.orders[kind]))

    @staticmethod
    def _recording(fn: Callable[[Any], Any], into: list[Any]) -> Callable[[Any], Any]:
        async def run(order: Any) -> Any:
            into.append(order)
            return await fn(order)

        return run

    def close(self) -> None:
        self.local.close()
        del self.local
        try:
            self._host_seg.close()
        except Exception:  # noqa: BLE001 - a lingering view: unmapped at exit
            pass

    def prompt(self, blocks: int) -> list[int]:
        self._next += 1
        # Distinct first tokens: distinct chains. Modulo a prime the steps of 4099 stay distinct for that many prompts,
        # and the ids below 2**31 - 1 (a long --observe-toggle run makes 640,000 prompts: 4099 * 640,000 > 2**31).
        base = self._next * 4099 % PROMPT_BASES
        if blocks * PAGE >= 1 << 20:
            raise ValueError(f"a prompt of {blocks} blocks: at most {(1 << 20) // PAGE - 1}")
        return list(range(base, base + blocks * PAGE + 1))

    def churn(self) -> None:
        with self.pool.lock:
            ids = self.pool.paged.allocate(self.pool.paged.available)
            self.pool.paged.release(ids)

    def seal(self, tokens: list[int]) -> float:
        """Compute a request's pages (no model: the bytes are whatever is there) and retire it; time until saved."""
        kv = RequestKv(self.pool, f"s{self._next}", tokens, 1)
        assert kv.try_admit(0)
        kv.schedule(len(tokens))
        kv.apply()
        t = time.perf_counter()
        self.store.retire(0, kv, SealCursor.after_prefix(0))
        self.store.flush_saves(0, 30)
        return time.perf_counter() - t

    def raw_trips(self, raw: _RawEcho, k: int = 2, churn: bool = True) -> float:
        """`k` raw round trips after the same churn a timed resolve gets (same cache state, same machine moment)."""
        if churn:
            self.churn()
        return raw.round_trips(k)

    def resolve(self, tokens: list[int], blocks: int, churn: bool = True, arm: str = "resolve",
                keep: bool = True) -> float:
        if churn:
            self.churn()
        self._rid += 1
        rid = f"r{self._rid}"
        copier: Any = self.store.copiers[0]
        loads_before = copier.loads_copied
        t = time.perf_counter()
        pre = self.store.submit_resolve(0, rid, tokens).result()
        dt = time.perf_counter() - t
        if pre.host_tokens != blocks * PAGE:
            raise RuntimeError(f"expected a host hit of {blocks} blocks, got {pre}")
        pre.hold.release()
        if keep and copier.loads_copied == loads_before + 1:
            copy_s = copier.load_copy_ns[-1] / 1e9
            self.net.setdefault(arm, []).append(dt - copy_s)
            self.copy_in_situ.setdefault(arm, []).append(copy_s)
        self.resolved[arm] += 1
        return dt

    def worker_load_clock(self) -> tuple[int, int]:
        """(ns, orders) the copy worker has spent executing Load orders so far (its own clock: the copy in situ)."""
        from kvproc.ipc import messages as m

        c = self.cs.cluster.client("copy_worker", 0).request(m.Stats(), timeout=5).counters
        return int(c.get("ns_load", 0)), int(c.get("orders_load", 0))

    def copy_times(self) -> tuple[float, float]:
        """Median in-process time of the Load and Save orders recorded since the last call (same segments)."""
        loads, saves = self.orders["load"], self.orders["save"]
        lt = [self._timed(functools.partial(self.local.load, o)) for o in loads]
        # A recorded save has committed: its fence is revoked and would refuse the replay. The replay rewrites the
        # same bytes into the same slots (timing only), so it runs without one.
        st = [self._timed(functools.partial(self.local.save, msgspec.structs.replace(o, fence=-1))) for o in saves]
        loads.clear()
        saves.clear()
        return _median_us(lt), _median_us(st)

    @staticmethod
    def _timed(fn: Callable[[], object]) -> float:
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t


def _ab_native(b: IpcBench, batches: int) -> dict[str, dict[str, float]]:
    """Median host-hit resolve with the store side's compiled helpers (hash chain, pool book-keeping) on vs
    off, in interleaved batches of 5 (ABBA) on one ClusterStore; the workers and the tier keep theirs."""
    from kvproc.core import hashing, paged

    native_mod = hashing.NATIVE
    out: dict[str, dict[str, float]] = {}
    if native_mod is None:
        return out
    for blocks in (16, 64, 256):
        prompts = [b.prompt(blocks) for _ in range(batches * 10)]
        for p in prompts:
            b.seal(p)
        it = iter(prompts)
        times: dict[str, list[float]] = {"native": [], "pure": []}
        try:
            for i in range(batches * 2):
                kind = ("native", "pure")[(i + i // 2) % 2]
                hashing.NATIVE = paged.NATIVE = native_mod if kind == "native" else None
                times[kind] += [b.resolve(next(it), blocks) for _ in range(5)]
        finally:
            hashing.NATIVE = paged.NATIVE = native_mod
        out[str(blocks)] = {k: round(_median_us(v), 1) for k, v in times.items()}
    return out


def _concurrent(b: IpcBench, per_thread: int, blocks: int) -> float:
    prompts = [[b.prompt(blocks) for _ in range(per_thread)] for _ in range(CONCURRENCY)]
    for ps in prompts:
        for p in ps:
            b.seal(p)
    b.churn()
    errors: list[BaseException] = []

    def worker(ps: list[list[int]]) -> None:
        try:
            for p in ps:
                b.store.resolve_prefix_sync(0, "c", p).hold.release()
        except BaseException as e:  # noqa: BLE001 - reported after the join
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(ps,)) for ps in prompts]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    dt = time.perf_counter() - t
    if errors:
        raise errors[0]
    return CONCURRENCY * per_thread / dt


class Observer:
    """`kvproc/bench/observer.py` in a child process for the bench's duration (a Prometheus server and a router are
    processes of their own: in this one they would take the store's GIL)."""

    def __init__(self, cs: ClusterStore, scrape_s: float = 1.0, device: bool = False, nice: int = 0) -> None:
        """`device`: also read rank 0's device-pool events (`device_kv_events=True`, after `attach_model`). `nice`:
        the observer's niceness (19: it takes only CPU kvproc's processes leave, as if it ran on another machine)."""
        from kvproc.tiers.kv_events import endpoints

        subs = [endpoints(cs.cluster.runtime_dir, 0)[0]] + ([endpoints(cs.cluster.runtime_dir, 0, "device")[0]]
                                                            if device else [])
        self.proc = subprocess.Popen([sys.executable, "-m", "kvproc.bench.observer", cs.cluster.metrics.address,
                                      ",".join(subs), str(scrape_s)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     preexec_fn=(lambda: os.nice(nice)) if nice else None)
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "ready":  # subscribed before anything is timed
            self.proc.kill()
            raise RuntimeError("the observer process did not start")

    def scrape_start(self) -> None:
        """With `scrape_s` 0 (scrapes on demand): start one scrape; `scrape_done` waits for it."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("scrape\n")
        self.proc.stdin.flush()

    def scrape_done(self) -> None:
        assert self.proc.stdout is not None
        if self.proc.stdout.readline().strip() != "scraped":
            raise RuntimeError("the observer process did not scrape")

    def close(self) -> dict[str, int]:
        out, _ = self.proc.communicate("", timeout=30)
        return dict(json.loads(out.strip().splitlines()[-1]))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvproc bench ipc", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="timed operations per cell")
    ap.add_argument("--quick", action="store_true", help="a few operations per cell (smoke test)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--ab-native", type=int, default=0, metavar="N",
                    help="also compare resolves with the store side's compiled helpers on vs off (N batches)")
    ap.add_argument("--kvproc-cpus", default=None, metavar="CPUS",
                    help="run the copy worker, the host tier and the raw echo server on these CPUs (e.g. 1 or 2,3): "
                         "kvproc's processes on cores of their own (default: wherever the OS puts them)")
    ap.add_argument("--observe", action="store_true",
                    help="with Prometheus /metrics scraped every second and KV events published and read (their cost)")
    ap.add_argument("--observe-ab", type=int, default=0, metavar="N",
                    help="only the observability A/B: N pairs of runs, plain vs observed, each its own process "
                         "(kvproc/bench/observe_ab.py; --n resolves per arm)")
    ap.add_argument("--plot", metavar="PATH", default=None,
                    help="PNG of resolve and seal time per block count, with the raw round trips")
    ap.add_argument("--observe-toggle", type=int, default=0, metavar="R",
                    help="only the observability A/B within one run: R rounds of --n resolves, observation switched "
                         "on and off every round (kvproc/bench/observe_toggle.py)")
    ap.add_argument("--toggled", choices=("all", "events", "metrics", "none"), default="all",
                    help="with --observe-toggle: what the on arm switches on (device-pool events, /metrics scrapes, "
                         "both, or nothing: the A/A control)")
    ap.add_argument("--alternate", choices=("round", "resolve"), default="round",
                    help="with --observe-toggle: switch every round (default) or every resolve within each round "
                         "(tighter; device-pool events only: --toggled events or none)")
    ap.add_argument("--scrape-s", type=float, default=1.0, help="/metrics scrape interval when observed (s)")
    ap.add_argument("--device-events", action="store_true",
                    help="with --observe-ab: the observed arm also publishes (and reads) rank 0's device-pool events "
                         "(ClusterStore.start(device_kv_events=True))")
    args = ap.parse_args(argv)
    n = 5 if args.quick else args.n
    if args.observe_toggle:
        from kvproc.bench import observe_toggle

        return observe_toggle.main(args.observe_toggle, n, 16, args.scrape_s, args.json, args.toggled,
                                   args.alternate)
    if args.observe_ab:
        from kvproc.bench import observe_ab

        return observe_ab.main(args.observe_ab, n, 16, args.scrape_s, args.json, args.device_events)
    sizes = [1, 16, 64, 256]
    cpus = tuple(int(c) for c in args.kvproc_cpus.split(",")) if args.kvproc_cpus else None
    if cpus:
        procutil.check_cpus(cpus, "--kvproc-cpus")
    raw = _RawEcho(cpus)
    raw_us = raw.hot_median_us(200 if args.quick else 3000)
    per_thread = 2 if args.quick else 20
    batches = max(1, (n + 9) // 10)  # each arm gets 2 x 5 samples per batch: >= n in all
    # One size's prompts must all stay on the host tier until resolved (older sizes' entries are evicted as needed).
    host_pages = (batches * PROMPTS_PER_BATCH + n + 8) * max(sizes) + CONCURRENCY * per_thread * 16 \
        + args.ab_native * 10 * (16 + 64 + 256) + 1024
    host_bytes = host_pages * 2 * ARENA_BLOCK + (1 << 20)
    results: list[dict[str, Any]] = []
    seals: list[dict[str, Any]] = []
    cs = ClusterStore.start(host_bytes, cpus={"copy_worker": cpus, "host_tier": cpus} if cpus else None,
                            metrics="127.0.0.1:0" if args.observe else None, kv_events=args.observe)
    observer = Observer(cs) if args.observe else None
    try:
        model = IpcBenchModel(cs.allocator, 2048)
        store = cs.attach_model(model, live_slots=CONCURRENCY, config=StoreConfig(
            cacheable_pin_fraction=1.0))
        b = IpcBench(cs, store, model)
        try:
            for blocks in sizes:
                print(f"  ipc bench: {blocks} blocks ...", file=sys.stderr, flush=True)
                warm = 3
                b.orders["load"].clear()
                b.orders["save"].clear()
                seal_t = [b.seal(b.prompt(blocks)) for _ in range(n + warm)][warm:]
                prompts = [b.prompt(blocks) for _ in range(batches * PROMPTS_PER_BATCH + warm)]
                for p in prompts:
                    b.seal(p)
                for p in prompts[:warm]:
                    b.resolve(p, blocks)
                it = iter(prompts[warm:])
                worker_ns, worker_orders = b.worker_load_clock()
                res_t: dict[str, list[float]] = {a: [] for a in ARMS}
                b.resolved.clear()
                b.net.clear()
                b.copy_in_situ.clear()
                for i in range(batches * 2):
                    for arm in ARMS if i % 2 == 0 else ARMS[::-1]:  # ABC.. ..CBA: no arm always goes first
                        if arm == "raw2":  # the round trips a host hit needs, after the same churn
                            res_t[arm] += [b.raw_trips(raw, 2) for _ in range(5)]
                        elif arm == "raw2_burst":
                            b.churn()
                            res_t[arm] += [b.raw_trips(raw, churn=False) for _ in range(6)][1:]
                        elif arm == "burst":  # back to back after one churn: the first one is dropped
                            b.churn()
                            res_t[arm] += [b.resolve(next(it), blocks, churn=False, arm=arm, keep=k > 0)
                                           for k in range(6)][1:]
                        else:
                            res_t[arm] += [b.resolve(next(it), blocks) for _ in range(5)]
                ns, orders = b.worker_load_clock()
                in_situ_us = (ns - worker_ns) / max(1, orders - worker_orders) / 1e3
                load_us, save_us = b.copy_times()
                seal_us = _median_us(seal_t)
                row: dict[str, Any] = {"blocks": blocks, "raw_rtt_us": round(raw_us, 1), "copy_us": round(load_us, 1),
                                       "copy_in_worker_us": round(in_situ_us, 1)}
                for arm, base in RESOLVE_ARMS:
                    rtt_us = _median_us(res_t[base]) / 2  # the raw round trip under the resolve's own conditions
                    us = _median_us(res_t[arm])
                    row[f"raw_rtt_{base}_us"] = round(rtt_us, 1)
                    row[f"resolve_{arm}_us"] = round(us, 1)
                    # each resolve less its own Load's copy as the worker timed it (the bytes' cost where and when
                    # they moved), then the two round trips it needs (Query, Load)
                    net_us = _median_us(b.net.get(arm, [float("nan")]))
                    row[f"{arm}_copy_in_situ_us"] = round(_median_us(b.copy_in_situ.get(arm, [float("nan")])), 1)
                    row[f"{arm}_one_load_share"] = round(len(b.net.get(arm, [])) / max(1, len(res_t[arm])), 3)
                    row[f"{arm}_overhead_beyond_needed"] = round((net_us - 2 * rtt_us) / rtt_us, 2)
                    row[f"{arm}_overhead_beyond_needed_replayed_copy"] = round((us - load_us - 2 * rtt_us) / rtt_us, 2)
                    row[f"{arm}_overhead_total_rtts"] = round(net_us / raw_us, 2)
                results.append(row)
                seals.append({"blocks": blocks, "seal_us": round(seal_us, 1), "copy_us": round(save_us, 1),
                              "seal_rtt_overhead": round((seal_us - save_us) / raw_us, 2)})
            print("  ipc bench: 16 concurrent resolvers ...", file=sys.stderr, flush=True)
            rps = _concurrent(b, per_thread, 16)
            ab_native = _ab_native(b, args.ab_native) if args.ab_native else {}
        finally:
            b.close()
    finally:
        observed = observer.close() if observer is not None else {}
        cs.close()
        raw.stop()
    if observed:
        print(f"# observed: {observed['metrics_scrapes']} /metrics scrapes, {observed['kv_event_batches_read']} KV "
              "event batches read during the run")
    load = os.getloadavg()[0]
    print(f"# control path, median of >= {n} per arm, raw 64 B round trip {raw_us:.0f} us hot (tight loop), "
          f"load {load:.2f}, hashing/pool/copy planning: {native.describe()}, "
          f"kvproc's processes and the raw echo "
          f"server on " + (f"CPUs {list(cpus)}" if cpus else "any CPU (not pinned)"))
    print("| blocks | copy in situ / replayed (us) | raw RTT after churn (us per trip) | resolve (us) "
          "| **overhead beyond 2 RTTs** | with the replayed copy | raw RTT, burst (us) | resolve, burst (us) "
          "| overhead beyond 2 RTTs | seal (us) | seal overhead (hot RTTs) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r, s in zip(results, seals):
        print(f"| {r['blocks']} | {r['resolve_copy_in_situ_us']:.0f} / {r['copy_us']:.0f} | "
              f"{r['raw_rtt_raw2_us']:.0f} | {r['resolve_resolve_us']:.0f} | "
              f"**{r['resolve_overhead_beyond_needed']:.2f}** | "
              f"{r['resolve_overhead_beyond_needed_replayed_copy']:.2f} | {r['raw_rtt_raw2_burst_us']:.0f} | "
              f"{r['resolve_burst_us']:.0f} | {r['burst_overhead_beyond_needed']:.2f} | {s['seal_us']:.0f} | "
              f"{s['seal_rtt_overhead']:.2f} |")
    print("copy of a resolve's Load order: the worker's own clock per order (median; what the overhead subtracts, "
          "resolve by resolve) / mean over every arm / the same orders replayed in-process (warm): " +
          ", ".join(f"{r['blocks']} blocks {r['resolve_copy_in_situ_us']:.0f} / {r['copy_in_worker_us']:.0f} / "
                    f"{r['copy_us']:.0f} us" for r in results))
    print("resolves with exactly one Load (the ones the overhead is taken over): " + ", ".join(
        f"{r['blocks']} blocks {r['resolve_one_load_share']:.0%}" for r in results))
    print(f"resolves/s with {CONCURRENCY} concurrent resolvers (16 blocks each): {rps:.0f}")
    for size, r in ab_native.items():
        print(f"A/B host-hit resolve of {size} blocks, {args.ab_native} x 10 each, interleaved: store-side "
              f"compiled helpers {r['native']:.0f} us, pure Python {r['pure']:.0f} us")
    if args.json:
        doc: dict[str, Any] = {"kvproc_cpus": list(cpus) if cpus else None, "results": results, "seal": seals,
                               "resolves_per_s": round(rps, 1), "raw_rtt_us": round(raw_us, 1),
                               "native": native.describe()}
        if ab_native:
            doc["ab_native_resolve_us"] = ab_native
        Path(args.json).write_text(json.dumps(doc, indent=2))
    if args.plot:
        from kvproc.bench.plot import lines

        series = {"resolve": [(r["blocks"], r["resolve_resolve_us"]) for r in results]}
        series["copy of the Load, in situ"] = [(r["blocks"], r["resolve_copy_in_situ_us"]) for r in results]
        series["raw round trip x 1 (after churn)"] = [(r["blocks"], r["raw_rtt_raw2_us"]) for r in results]
        series["seal (retire until saved)"] = [(s["blocks"], s["seal_us"]) for s in seals]
        lines(args.plot, series, title="kvproc bench ipc: host-hit resolve and seal", xlabel="blocks",
              ylabel="us (median)", logx=True, logy=True)
    return 0


__all__ = ["main"]
