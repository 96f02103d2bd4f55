"""`kvproc bench remote`: the Mooncake tier's write-behind and pull throughput against raw `batch_put_from` /
`batch_get_into` of the same bytes, in the same run, on a loopback Mooncake Store this benchmark starts and stops.

- raw: one contiguous buffer per page (the ideal layout), batches of `--batch` pages, one call each;
- kvproc: `MooncakeTier` as the host tier runs it: host-index saves committed and handed to `write_behind` (a lease,
  an existence check, `batch_put_from_multi_buffers` from the host layout: one buffer per paged arena region, here
  K and V), timed from the first commit until the queue is written; a pull is a second node's `probe` of the whole
  prompt (an existence check, host slots reserved, `batch_get_into_multi_buffers`, the save committed), timed from the
  probe until the pages are committed in its index. The pulled bytes are checked against the written ones.

Each measurement is the best of `--repeats`, fresh keys each time (a key already in Mooncake is never rewritten).
Needs `kvproc[remote]` (and libibverbs).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import threading
import time
from typing import Any

import numpy as np

from kvproc.tiers.host_index import HostIndex, QueryResult, SaveClass, SaveTicket
from kvproc.tiers.layout import HostLayout, Region
from kvproc.tiers.mooncake import MooncakeTier
from kvproc.tiers.mooncake_client import MooncakeClient, RemoteSpec
from kvproc.tiers.mooncake_local import LocalMooncake

SIZES = {"1MiB": 1 << 20, "4MiB": 4 << 20, "16MiB": 16 << 20}


class _Host:
    """One node's host memory (anonymous, pre-faulted), index and Mooncake tier over it."""

    def __init__(self, spec: RemoteSpec, fingerprint: str, page: int, pages: int) -> None:
        self.mem = mmap.mmap(-1, page * pages)
        self.view = np.frombuffer(self.mem, dtype=np.uint8)
        self.view[::4096] = 0  # pre-fault
        self.addr = ctypes.addressof(ctypes.c_char.from_buffer(self.mem))
        half = page // 2
        self.layout = HostLayout((Region("k", "kv", 0, half, pages), Region("v", "kv", half * pages, half, pages)),
                                 pages, {}, page * pages)
        self.index = HostIndex(pages, high_watermark=1.0, save_ttl_s=600, lease_ttl_s=600)
        self.lock = threading.Lock()
        self.tier = MooncakeTier(spec, fingerprint=fingerprint, layout=self.layout, segment_addr=self.addr,
                                 index=self.index, lock=self.lock, settled=lambda: None, max_pull_pages=pages,
                                 write_batch_pages=64)
        end = time.monotonic() + 30
        while not self.tier.client.connected:
            if time.monotonic() > end:
                raise TimeoutError("the Mooncake tier did not connect")
            time.sleep(0.01)

    def page_bytes(self, slot: int) -> bytes:
        half = self.layout.regions[0].unit_bytes
        k, v = self.layout.regions
        return bytes(self.view[k.offset + slot * half:k.offset + (slot + 1) * half]) + \
            bytes(self.view[v.offset + slot * half:v.offset + (slot + 1) * half])

    def close(self) -> None:
        self.tier.close()
        del self.view
        try:
            self.mem.close()
        except BufferError:  # Mooncake's engine may still reference the mapping: the process exit unmaps it
            pass


def _write_behind(node: _Host, hashes: list[bytes], batch: int, timeout: float) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(hashes), batch):
        with node.lock:
            t = node.index.reserve_save("bench", hashes[i:i + batch], (), SaveClass.CACHEABLE)
            assert isinstance(t, SaveTicket), t
            node.index.commit_save(t.save_id)
            node.tier.write_behind(t)
    if not node.tier.flush(timeout):
        raise TimeoutError("write-behind did not finish")
    took = time.perf_counter() - t0
    st = node.tier.stats()
    if st.get("remote.writes_refused", 0) or st.get("remote.writes_shed_unreachable", 0):
        raise RuntimeError(f"write-behind lost pages: {st}")
    return took


def _pull(node: _Host, hashes: list[bytes], timeout: float) -> float:
    answered = threading.Event()

    def answer(res: QueryResult) -> bool:
        answered.set()
        return True

    before = node.tier.counters["pulls_ok"]
    t0 = time.perf_counter()
    node.tier.probe("bench", hashes, 0, timeout, answer)
    end = time.monotonic() + timeout
    while node.tier.counters["pulls_ok"] == before:
        if time.monotonic() > end or node.tier.counters["pulls_failed"] or node.tier.counters["pulls_timeout"]:
            raise RuntimeError(f"pull failed: {node.tier.stats()}")
        time.sleep(0.0005)
    took = time.perf_counter() - t0
    with node.lock:
        assert node.index.committed_run(hashes) == len(hashes)
    assert answered.is_set()
    return took


def _raw(client: MooncakeClient, keys: list[str], addr: int, page: int, batch: int, put: bool) -> float:
    t0 = time.perf_counter()
    for i in range(0, len(keys), batch):
        ks = keys[i:i + batch]
        ptrs = [[addr + (i + j) * page] for j in range(len(ks))]
        sizes = [[page]] * len(ks)
        codes = client.put_from(ks, ptrs, sizes) if put else client.get_into(ks, ptrs, sizes)
        want = 0 if put else page
        if any(c != want for c in codes):
            raise RuntimeError(f"raw {'put' if put else 'get'} failed: {sorted(set(codes))}")
    return time.perf_counter() - t0


def run_size(mc: LocalMooncake, name: str, page: int, total: int, batch: int, repeats: int) -> dict[str, Any]:
    pages = max(1, total // page)
    nbytes = pages * page
    spec = RemoteSpec.parse(mc.url + "&timeout=30")
    rng = np.random.default_rng(7)
    best: dict[str, float] = {}
    for rep in range(repeats):
        fp = f"bench-remote-{name}-{rep}-{os.getpid()}"
        a = _Host(spec, fp, page, pages)
        b = _Host(spec, fp, page, pages)
        raw_mem = mmap.mmap(-1, nbytes)
        raw_view = np.frombuffer(raw_mem, dtype=np.uint8)
        raw_addr = ctypes.addressof(ctypes.c_char.from_buffer(raw_mem))
        raw = MooncakeClient(spec, raw_addr, nbytes)
        try:
            a.view[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
            raw_view[:] = a.view  # the same bytes (contiguous per page here)
            raw.exists(["warm-up"])
            hashes = [rng.bytes(16) for _ in range(pages)]
            keys = [f"raw/{fp}/{i}" for i in range(pages)]
            times = {
                "raw_put": _raw(raw, keys, raw_addr, page, batch, put=True),
                "write_behind": _write_behind(a, hashes, batch, 120),
            }
            raw_view[:] = 0
            times["raw_get"] = _raw(raw, keys, raw_addr, page, batch, put=False)
            times["pull"] = _pull(b, hashes, 120)
            if not np.array_equal(raw_view, a.view):
                raise AssertionError("raw get returned other bytes")
            with b.lock:
                slots = [b.index.entries[h] for h in hashes]
            with a.lock:
                a_slots = [a.index.entries[h] for h in hashes]
            for h, sa, sb in zip(hashes[:8] + hashes[-8:], a_slots[:8] + a_slots[-8:], slots[:8] + slots[-8:]):
                if a.page_bytes(sa) != b.page_bytes(sb):
                    raise AssertionError(f"pulled page {h.hex()} differs from the written one")
            for k, v in times.items():
                best[k] = min(best.get(k, float("inf")), v)
        finally:
            raw.close()
            a.close()
            b.close()
            del raw_view
            try:
                raw_mem.close()
            except BufferError:
                pass
    gbs = {k: nbytes / v / 1e9 for k, v in best.items()}
    return {"page": name, "pages": pages, "bytes": nbytes, "batch": batch, "repeats": repeats,
            **{f"{k}_GBps": round(v, 3) for k, v in gbs.items()},
            "write_behind_vs_raw_put": round(gbs["write_behind"] / gbs["raw_put"], 3),
            "pull_vs_raw_get": round(gbs["pull"] / gbs["raw_get"], 3)}


def _latency(args: argparse.Namespace) -> int:
    from kvproc.bench.remote_latency import run_latency

    with LocalMooncake.start(segment_mb=256) as mc:
        row = run_latency(mc, model=args.model, prompts=args.prompts, prompt_tokens=args.prompt_tokens)
    print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([row], f, indent=1)
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvproc bench remote", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="1MiB,4MiB", help=f"page sizes, of {', '.join(SIZES)}")
    p.add_argument("--total-mib", type=int, default=64, help="bytes per measurement")
    p.add_argument("--batch", type=int, default=64, help="pages per raw call and per committed save")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("--latency", action="store_true",
                   help="instead: what a remote hit adds to a resolve (`kvproc/bench/remote_latency.py`)")
    p.add_argument("--prompts", type=int, default=20, help="--latency: prompts (each resolved remote, then host)")
    p.add_argument("--prompt-tokens", type=int, default=256, help="--latency: tokens per prompt")
    p.add_argument("--model", default="dense", help="--latency: the reference model")
    args = p.parse_args(argv)
    if args.latency:
        return _latency(args)
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    # Capacity for every measurement's keys (raw and kvproc, each repeat): nothing is evicted during the run.
    seg_mb = 2 * len(sizes) * args.repeats * args.total_mib + 256
    rows = []
    with LocalMooncake.start(segment_mb=seg_mb) as mc:
        for s in sizes:
            row = run_size(mc, s, SIZES[s], args.total_mib << 20, args.batch, args.repeats)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'page':>6} {'raw put':>9} {'write-behind':>13} {'ratio':>6} {'raw get':>9} {'pull':>9} {'ratio':>6}  (GB/s)")
    for r in rows:
        print(f"{r['page']:>6} {r['raw_put_GBps']:>9.3f} {r['write_behind_GBps']:>13.3f} "
              f"{r['write_behind_vs_raw_put']:>6.2f} {r['raw_get_GBps']:>9.3f} {r['pull_GBps']:>9.3f} "
              f"{r['pull_vs_raw_get']:>6.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
