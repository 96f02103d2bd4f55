"""The vLLM connector's page copies in SGLang's format (`page_format="sglang"`: one vectorised numpy repack per batch,
`kvproc/integrations/vllm/sglang_format.py`) against its default format's (one native row copy per layer,
`MEMMOVE.rows`, as `KvprocConnector._copy_rows` runs them), the same pages alternated, in this process.

    .venv/bin/python bench/sglang_page_repack.py [--n 20] [--pages 16]

The page of an 8B Llama-like model on vLLM-CPU (32 layers, 8 KV heads of 128, bfloat16, 32-token blocks: 128 KiB a
layer, 4 MiB a page), a batch of scattered blocks and tier slots, saved (vLLM -> tier) and loaded (tier -> vLLM).
Medians in GB/s of page bytes, and the repack's ratio to the default copy.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvproc.integrations.vllm.sglang_format import PERMUTATIONS, SglangPages
from kvproc.workers.movers import MEMMOVE

LAYERS, HEADS, HEAD_DIM, ITEM, PAGE = 32, 8, 128, 2, 32
BLOCKS, SLOTS = 96, 96


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20, help="batches per cell")
    ap.add_argument("--pages", type=int, default=16, help="pages a batch")
    args = ap.parse_args()
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    rng = np.random.default_rng(0)
    fmts = {lay: SglangPages.for_vllm(lay, names, HEADS, HEAD_DIM, HEAD_DIM, ITEM, "bfloat16", PAGE)
            for lay in ("page_first", "page_head")}
    bb = next(iter(fmts.values())).block_bytes
    kv = {n: rng.integers(0, 256, (BLOCKS, bb), dtype=np.uint8) for n in names}
    arenas = {n: np.zeros((SLOTS, bb), dtype=np.uint8) for n in names}  # the default format: an arena a layer
    rows = np.zeros((SLOTS, LAYERS * bb), dtype=np.uint8)  # SGLang's: one row a page
    page_bytes = LAYERS * bb
    cells: dict[str, list[float]] = {}
    for _ in range(args.n):
        ids = rng.choice(BLOCKS, args.pages, replace=False).tolist()
        slots = rng.choice(SLOTS, args.pages, replace=False).tolist()

        def default(to_vllm: bool) -> None:
            for n in names:
                if to_vllm:
                    MEMMOVE.rows(kv[n].reshape(-1), bb, ids, arenas[n].reshape(-1), bb, slots, bb, 0)
                else:
                    MEMMOVE.rows(arenas[n].reshape(-1), bb, slots, kv[n].reshape(-1), bb, ids, bb, 0)

        runs = {("vllm", "save"): lambda: default(False), ("vllm", "load"): lambda: default(True)}
        for lay, f in fmts.items():
            runs[(lay, "save")] = lambda f=f: f.to_rows(kv, ids, rows, slots)
            runs[(lay, "load")] = lambda f=f: f.from_rows(rows, slots, kv, ids)
        for (fmt, op), fn in runs.items():
            t0 = time.perf_counter()
            fn()
            cells.setdefault(f"{fmt} {op}", []).append(args.pages * page_bytes / (time.perf_counter() - t0) / 1e9)
    print(f"{args.pages} pages of {page_bytes >> 20} MiB a batch, {args.n} batches, median GB/s "
          f"(layouts: {sorted(PERMUTATIONS)} tested: page_first, page_head)")
    for op in ("save", "load"):
        base = statistics.median(cells[f"vllm {op}"])
        line = f"  {op}: default (per-layer memcpy) {base:.2f}"
        for lay in fmts:
            m = statistics.median(cells[f"{lay} {op}"])
            line += f" | sglang {lay} {m:.2f} ({m / base:.2f}x)"
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
