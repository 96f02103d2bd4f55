"""How a resolving thread waits for the copy worker's reply, A/B: paired batches of blocking 64-page host hits.

    .venv/bin/python bench/wait_ab.py [--blocks 64] [--batches 40]

The direct call's blocking receive against a `zmq_poll` of the socket and the death fd
(`kvproc.ipc.direct.BLOCKING_RECEIVE`). (Its `spin` knob, a poll for the reply without sleeping, went with the spin
itself: bench/RESULTS.md, "Control path", the end-to-end A/B.) Each batch runs 5 resolves per arm (the order of the
arms alternating) and 5 raw round trips, after the bench's pool churn each, so the two arms of a batch see the same
moment of a noisy shared host; printed: medians of the per-batch medians of resolve time less its Load's copy
(`Copied.ns`), the median paired difference, and the same over the batches whose raw round trip was below / above
the median (a fast and a slow phase of the host).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from kvproc.bench.ipcbench import ARENA_BLOCK, CONCURRENCY, IpcBench, IpcBenchModel, _RawEcho
from kvproc.ipc import direct
from kvproc.store.cluster import ClusterStore
from kvproc.store.types import StoreConfig


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--batches", type=int, default=40)
    args = ap.parse_args()
    per = 5
    n_prompts = args.batches * per * 2 + per
    cs = ClusterStore.start(n_prompts * args.blocks * 2 * ARENA_BLOCK + (8 << 20), log_level="warning")
    raw = _RawEcho()
    try:
        model = IpcBenchModel(cs.allocator, max(2048, 4 * args.blocks))
        store = cs.attach_model(model, live_slots=CONCURRENCY, config=StoreConfig(cacheable_pin_fraction=1.0))
        b = IpcBench(cs, store, model)
        prompts = [b.prompt(args.blocks) for _ in range(n_prompts)]
        for p in prompts:
            b.seal(p)
        time.sleep(0.5)  # the last commits land: every page is verifiable
        it = iter(prompts)
        for _ in range(per):  # warm-up
            b.resolve(next(it), args.blocks)
        arms = ("on", "off")
        rows: list[dict[str, float]] = []
        try:
            for i in range(args.batches):
                row: dict[str, float] = {}
                for arm in arms if i % 2 == 0 else arms[::-1]:
                    direct.BLOCKING_RECEIVE = arm == "on"
                    b.net.clear()
                    for _ in range(per):
                        b.resolve(next(it), args.blocks, arm="x")
                    row[arm] = statistics.median(b.net["x"])
                direct.BLOCKING_RECEIVE = True
                row["raw"] = statistics.median(b.raw_trips(raw, 1) for _ in range(per))
                rows.append(row)
        finally:
            direct.BLOCKING_RECEIVE = True
            b.close()
    finally:
        raw.stop()
        cs.close()
    cut = statistics.median(r["raw"] for r in rows)
    label = "blocking receive / poll"
    print(f"# {args.blocks}-page verified host hits, {args.batches} batches x {per} per arm; {label}; net of the copy")
    for name, sel in (("all", rows), ("fast half", [r for r in rows if r["raw"] < cut]),
                      ("slow half", [r for r in rows if r["raw"] >= cut])):
        if not sel:
            continue
        med = {k: statistics.median(r[k] for r in sel) * 1e6 for k in ("on", "off", "raw")}
        diff = statistics.median(r["on"] - r["off"] for r in sel) * 1e6
        print(f"{name:10s} raw RTT {med['raw']:6.0f} us | on {med['on']:6.0f} us | off {med['off']:6.0f} us | "
              f"paired difference {diff:+6.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
