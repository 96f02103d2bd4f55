"""A repacked arena's copies: the reference MLA model's latent pages (9 KiB executed, 10.25 KiB stored in its wire
layout with per-tile scales and a checksum, `kvproc/engine/models/wire.py`) saved and loaded by a `CopyExecutor` in
this process, its blocks through the hook in batches (`CopyExecutor.batch_repack`, the default) against one hook call
per run (the path before), the same orders alternated.

    .venv/bin/python bench/repack_copy.py [--n 100]

Orders of 1, 16 and 64 blocks at scattered device ids and host slots (nothing coalesces: a run per block), and 64
contiguous ones; the model's three latent arenas are repacked, its three indexer arenas are plain copies. Medians in
microseconds per order.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import numpy as np

from kvproc.contract import validate_layout
from kvproc.engine.models.mla import MlaModel
from kvproc.ipc.orders import LoadOrder, SaveOrder
from kvproc.tiers.layout import HostLayout
from kvproc.workers.copy_exec import CopyExecutor

BLOCKS = 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100, help="orders per cell")
    args = ap.parse_args()
    model = MlaModel(BLOCKS, 4)
    layout = validate_layout(model.spec(), model.arenas(0))
    host_layout = HostLayout.plan(layout, 256 << 20)
    ex = CopyExecutor(layout, np.zeros(host_layout.total_bytes, dtype=np.uint8), host_layout, repack=model.repack)
    rng = random.Random(0)
    slots = min(host_layout.page_slots, 4 * BLOCKS)
    cells = [(f"{k} scattered", k, False) for k in (1, 16, 64)] + [("64 contiguous", 64, True)]
    print(f"{'order':<14} {'op':<5} {'batched (us)':>13} {'per run (us)':>13} {'ratio':>6}")
    for name, k, contiguous in cells:
        times: dict[tuple[str, bool], list[float]] = {}
        for i in range(args.n):
            ids = list(range(k)) if contiguous else rng.sample(range(BLOCKS), k)
            host = list(range(100, 100 + k)) if contiguous else rng.sample(range(slots), k)
            for batched in ((True, False) if i % 2 else (False, True)):  # alternated: neither always goes first
                ex.batch_repack = batched
                for op, run in (("save", lambda: ex.save(SaveOrder("b", ids, host))),
                                ("load", lambda: ex.load(LoadOrder("b", host, ids)))):
                    t = time.perf_counter()
                    run()
                    times.setdefault((op, batched), []).append(time.perf_counter() - t)
        for op in ("save", "load"):
            b = statistics.median(times[(op, True)]) * 1e6
            p = statistics.median(times[(op, False)]) * 1e6
            print(f"{name:<14} {op:<5} {b:>13.0f} {p:>13.0f} {p / b:>6.1f}", flush=True)
    ex.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
