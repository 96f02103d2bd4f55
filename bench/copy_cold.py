"""What a host hit's copy costs when its bytes are not in any cache: the same 64-page Load orders, copied in this
process over a real cluster's segments, (a) back to back, (b) after the bench's pool churn and (c) after writing
256 MiB of other memory (more than this machine's last-level cache), so the pages come from DRAM.

    .venv/bin/python bench/copy_cold.py [--orders 200] [--blocks 64]

Why it exists: `kvproc bench ipc` subtracts each resolve's own copy as the copy worker timed it (`Copied.ns`), not
an in-process replay of the same orders, because the replay runs right after the worker read those bytes and finds
them in the shared cache. This shows the size of that difference on this machine. A diagnostic, not a benchmark
with a target: pages of 2 arenas x 2 KiB, host slots and device blocks drawn at random.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Callable

import numpy as np

from kvproc.bench.ipcbench import IpcBench, IpcBenchModel
from kvproc.ipc.orders import LoadOrder
from kvproc.store.cluster import ClusterStore
from kvproc.store.types import StoreConfig

EVICT_BYTES = 256 << 20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--orders", type=int, default=200)
    ap.add_argument("--blocks", type=int, default=64)
    args = ap.parse_args()
    cs = ClusterStore.start(64 << 20, log_level="warning")
    try:
        model = IpcBenchModel(cs.allocator, 2048)
        store = cs.attach_model(model, live_slots=16, config=StoreConfig())
        b = IpcBench(cs, store, model)
        host = b.local.arenas[0].host
        assert host is not None
        slots = host.shape[0]
        rng = random.Random(0)
        orders = [LoadOrder("cold", sorted(rng.sample(range(slots), args.blocks)),
                            rng.sample(range(2048), args.blocks), []) for _ in range(args.orders)]
        other = np.zeros(EVICT_BYTES, dtype=np.uint8)

        def evict() -> None:
            other[::64] += 1  # one write per cache line

        def timed(before: Callable[[], None]) -> float:
            xs = []
            for o in orders:
                before()
                t = time.perf_counter()
                b.local.load(o)
                xs.append(time.perf_counter() - t)
            return statistics.median(xs) * 1e6

        for rep in range(2):
            print(f"run {rep + 1}: {args.blocks}-page Load, median of {args.orders} (us): back to back "
                  f"{timed(lambda: None):.1f}, after the pool churn {timed(b.churn):.1f}, after writing "
                  f"{EVICT_BYTES >> 20} MiB {timed(evict):.1f}", flush=True)
        b.close()
        store.close()
    finally:
        cs.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
