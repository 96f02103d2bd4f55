"""What device-pool KV events cost on the prefix index's hot path, A/B in one run: before (the tree at `--base`:
its `kvproc/core/paged.py` and its compiled helpers, built here into a temp dir) against now with events off (no
listener) and on (a `DeviceIndexEvents` publishing to a real `KvEventPublisher`).

    .venv/bin/python bench/device_events_cost.py [--base 51527ac] [--pages 16] [--iters 300] [--rounds 60]

Two levels, each timed per iteration, the arms interleaved (order rotating) for `--rounds` short rounds (a loaded
host's swings hit every arm alike); printed: the median and the best (minimum) round of each arm, and their ratios to
`before`, and the median over rounds of each round's ratio to `before` (the arms of one round ran within
milliseconds of each other):
- `helpers`: `paged_register` of `--pages` fresh hashes then `paged_unhash` of those blocks (the C calls alone);
- `pool`: `PagedBlocks` in steady state: `allocate(pages)` (evicts as many cached blocks: unhash), `register`,
  `release` (the blocks go back to the LRU), the path a prefill's pages take.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import types
from collections.abc import Callable

import numpy as np
from base_tree import module_at, native_at

from kvproc import native
from kvproc.core import paged
from kvproc.tiers.device_index_events import DeviceIndexEvents
from kvproc.tiers.kv_events import KvEventPublisher


def build_base(rev: str, tmp: str) -> tuple[types.ModuleType, types.ModuleType]:
    """(compiled helpers, paged.py) of `rev`, loaded beside the current ones."""
    nat = native_at(rev, tmp)
    return nat, module_at(rev, "kvproc/core/paged.py", tmp, nat)


class Hashes:
    """Fresh 16-byte keys, made before the timing."""

    def __init__(self, n: int) -> None:
        self.keys = [i.to_bytes(16, "big") for i in range(n)]
        self.at = 0

    def take(self, n: int) -> list[bytes]:
        out = self.keys[self.at : self.at + n]
        self.at += n
        return out


def helper_arm(mod: types.ModuleType, pages: int, iters: int, with_lists: bool) -> Callable[[], float]:
    def run() -> float:
        n = 4 * pages
        hashed = np.zeros(n, dtype=bool)
        block_hash: list[bytes | None] = [None] * n
        index: dict[bytes, int] = {}
        ids = list(range(pages))
        hs = Hashes(pages * iters)
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            if with_lists:
                added: list[int] = []
                removed: list[bytes] = []
                mod.paged_register(hashed, block_hash, index, ids, hs.take(pages), added)
                mod.paged_unhash(hashed, block_hash, index, ids, removed)
            else:
                mod.paged_register(hashed, block_hash, index, ids, hs.take(pages))
                mod.paged_unhash(hashed, block_hash, index, ids)
        return (time.perf_counter_ns() - t0) / iters
    return run


def pool_arm(paged_mod: types.ModuleType, pages: int, iters: int, listener: object | None) -> Callable[[], float]:
    def run() -> float:
        pb = paged_mod.PagedBlocks(4 * pages)
        if listener is not None:
            pb.listener = listener
        hs = Hashes(pages * (iters + 8))
        # the pages' token ids as a computed page registers them (a view of the request's int64 buffer)
        tokens = np.arange(pages * 16, dtype=np.int64) + 1000
        extra = () if listener is None else (0, None)  # as the engine calls it: tokens only for a listener
        for _ in range(8):  # steady state: no free blocks, every allocation evicts
            ids = pb.allocate(pages)
            pb.register(ids, hs.take(pages), *((tokens[:],) + extra if extra else ()))
            pb.release(ids)
        t0 = time.perf_counter_ns()
        for _ in range(iters):
            ids = pb.allocate(pages)
            pb.register(ids, hs.take(pages), *((tokens[:],) + extra if extra else ()))
            pb.release(ids)
        return (time.perf_counter_ns() - t0) / iters
    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="51527ac", help="the tree before device events (a git revision)")
    ap.add_argument("--pages", type=int, default=16)
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=60)
    args = ap.parse_args()
    if native.NATIVE is None:
        print("the compiled helpers are not built (or KVPROC_PURE_PYTHON=1): nothing to compare", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kvproc-devev-") as tmp:
        base_nat, base_paged = build_base(args.base, tmp)
        pub = KvEventPublisher(tmp, 0, kind="device")
        try:
            on = DeviceIndexEvents(pub, 16)
            arms: dict[str, Callable[[], float]] = {
                "helpers before": helper_arm(base_nat, args.pages, args.iters, False),
                "helpers off": helper_arm(native.NATIVE, args.pages, args.iters, False),
                "helpers on (lists)": helper_arm(native.NATIVE, args.pages, args.iters, True),
                "pool before": pool_arm(base_paged, args.pages, args.iters, None),
                "pool off": pool_arm(paged, args.pages, args.iters, None),
                "pool on (publishing)": pool_arm(paged, args.pages, args.iters, on),
            }
            times: dict[str, list[float]] = {k: [] for k in arms}
            names = list(arms)
            for r in range(args.rounds):
                for k in names[r % len(names):] + names[: r % len(names)]:
                    times[k].append(arms[k]())
                pub.flush()
        finally:
            pub.close()
    med = {k: statistics.median(v) for k, v in times.items()}
    best = {k: min(v) for k, v in times.items()}
    print(f"{args.pages} pages per iteration, {args.iters} iterations x {args.rounds} rounds, base {args.base}; "
          "ns per iteration (median round, best round), and the median over rounds of the round's ratio to before")
    for level in ("helpers", "pool"):
        base = f"{level} before"
        mb, bb = med[base], best[base]
        for k in names:
            if k.startswith(level):
                paired = statistics.median(a / b for a, b in zip(times[k], times[base]))
                print(f"  {k:24s} median {med[k]:9.0f} ns {med[k] / mb:6.3f}x   best {best[k]:9.0f} ns "
                      f"{best[k] / bb:6.3f}x   paired {paired:6.3f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
