"""`kvproc bench copy`: the copy path (save device->host, load host->device) against `numpy.copyto` of the same bytes.

Both sides live in POSIX shared memory, pre-faulted (as kvproc's segments are), so neither run pays first-touch page
faults. The baseline is one `np.copyto` of the whole batch, contiguous: the physical limit for that byte volume in the
same run. "scattered" permutes the device block ids (and host slots), so nothing coalesces. Where an arena's pages
are stored as they execute (no repack hook), blocks move in one `kvproc.native._native.copy_rows` call per arena (ids
checked, then one memmove per run). The same scattered orders also run on the numpy path ("scattered, numpy":
`CopyExecutor.use_copy_rows = False`, the path before `copy_rows` and the fallback where the module is not built:
below `GATHER_MAX_BLOCK_BYTES` one fancy-index gather per arena, from it on one slice copy per block), in the same
run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from kvproc.contract import GroupKind, GroupSpec, KvArena, KvSpec, validate_layout
from kvproc.ipc.orders import LoadOrder, SaveOrder
from kvproc.tiers.layout import HostLayout
from kvproc.workers.copy_exec import CopyExecutor

SIZES = {"4KiB": 4 << 10, "64KiB": 64 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}


def best_time(fn: Callable[[], object], repeats: int, *, warm: bool = False) -> float:
    """The fastest of `repeats` calls of `fn` (seconds); `warm`: one untimed call first (page faults, first touch,
    lazy CUDA init are not the copy's cost)."""
    if warm:
        fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure(block_bytes: int, batch_bytes: int, repeats: int, seed: int = 0) -> list[dict[str, Any]]:
    n = max(2, batch_bytes // block_bytes)
    dev = torch.zeros(2 * n * block_bytes, dtype=torch.uint8)  # twice the batch: scattered ids have room
    dev.numpy()[:] = np.random.default_rng(seed).integers(0, 256, dev.numel(), dtype=np.uint8)
    spec = KvSpec(16, (GroupSpec("kv", GroupKind.PAGED),))
    layout = validate_layout(spec, [("kv", KvArena("kv", dev, 2 * n, block_bytes, block_bytes))])
    hl = HostLayout.plan(layout, 2 * n * block_bytes + (1 << 16))
    host = np.zeros(hl.total_bytes, dtype=np.uint8)
    host[:] = 1  # pre-fault
    ex = CopyExecutor(layout, host, hl)
    rng = np.random.default_rng(seed)
    src_a = dev.numpy()[: n * block_bytes]
    dst_a = host[: n * block_bytes]
    memcpy_s = best_time(lambda: np.copyto(dst_a, src_a), repeats)
    out: list[dict[str, Any]] = []
    layouts = ["contiguous", "scattered", "scattered, numpy"]
    scattered = rng.permutation(2 * n)[:n].tolist(), rng.permutation(min(hl.page_slots, 2 * n))[:n].tolist()
    for layout_name in layouts:
        if layout_name == "contiguous":
            ids, slots = list(range(n)), list(range(n))
        else:
            ids, slots = scattered
        ex.use_copy_rows = layout_name != "scattered, numpy"
        _measure_ops(ex, ids, slots, n, block_bytes, memcpy_s, repeats, layout_name, out)
    ex.close()
    return out


def _measure_ops(ex: CopyExecutor, ids: list[int], slots: list[int], n: int, block_bytes: int, memcpy_s: float,
                 repeats: int, layout_name: str, out: list[dict[str, Any]]) -> None:
    for op in ("save", "load"):
        if op == "save":
            order = SaveOrder("bench", ids, slots)
            t = best_time(lambda: ex.save(order), repeats)
        else:
            lorder = LoadOrder("bench", slots, ids)
            t = best_time(lambda: ex.load(lorder), repeats)
        gbps = n * block_bytes / t / 1e9
        mgbps = n * block_bytes / memcpy_s / 1e9
        out.append({"op": op, "block_bytes": block_bytes, "layout": layout_name, "gbps": round(gbps, 2),
                    "memcpy_gbps": round(mgbps, 2), "ratio_vs_memcpy": round(gbps / mgbps, 3)})


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvproc bench copy", description=__doc__.splitlines()[0])
    ap.add_argument("--batch-mib", type=int, default=256, help="bytes per batch (default 256 MiB)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="tiny batches, one repeat (smoke test)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", metavar="PATH", default=None, help="PNG of GB/s per block size, one line per path")
    args = ap.parse_args(argv)
    batch = (4 << 20) if args.quick else args.batch_mib << 20
    repeats = 1 if args.quick else args.repeats
    rows: list[dict[str, Any]] = []
    sizes = {"4KiB": 4 << 10, "64KiB": 64 << 10} if args.quick else SIZES
    for name, size in sizes.items():
        print(f"  copy bench: {name} blocks ...", file=sys.stderr, flush=True)
        rows += measure(size, batch, repeats)
    print(f"{'op':<5} {'block':>8} {'layout':<20} {'GB/s':>7} {'memcpy GB/s':>12} {'ratio':>6}")
    for r in rows:
        print(f"{r['op']:<5} {r['block_bytes']:>8} {r['layout']:<20} {r['gbps']:>7} {r['memcpy_gbps']:>12} "
              f"{r['ratio_vs_memcpy']:>6}")
    if args.json:
        Path(args.json).write_text(json.dumps({"results": rows}, indent=2))
    if args.plot:
        from kvproc.bench.plot import lines

        series: dict[str, list[tuple[float, float]]] = {}
        for r in rows:
            series.setdefault(f"{r['op']}, {r['layout']}", []).append((r["block_bytes"], r["gbps"]))
            series.setdefault(f"{r['op']}, np.copyto (contiguous)", []).append((r["block_bytes"], r["memcpy_gbps"]))
        series = {k: sorted(set(v)) for k, v in series.items()}
        lines(args.plot, series, title="kvproc bench copy: copy path vs np.copyto", xlabel="block bytes",
              ylabel="GB/s", logx=True)
    return 0
