"""Where a blocking host-hit resolve spends its time: the median moment each step starts and ends.

    .venv/bin/python bench/resolve_timeline.py [--blocks 64] [--n 250] [--form verified|speculative|plain]

A `ClusterStore` (host tier and copy worker processes), prompts saved by the same store, then `n` resolves of
`blocks` pages each after a churn of the device pool (as in `kvproc bench ipc`). The store's steps are wrapped in
this process to stamp `time.perf_counter()` at their entry and exit (`>` / `<`); `wait` is the calling thread
blocked on its socket for a reply. Printed: the median of each stamp since the resolve started, and the step since
the previous stamp. A diagnostic, not a benchmark: the wrappers add ~1 us per stamp.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any, Callable

from kvproc.bench.ipcbench import ARENA_BLOCK, CONCURRENCY, IpcBench, IpcBenchModel
from kvproc.ipc import direct
from kvproc.store import resolve as store_resolve
from kvproc.store.cluster import ClusterStore
from kvproc.store.types import StoreConfig

FORMS = {
    "verified": StoreConfig(cacheable_pin_fraction=1.0),
    "speculative": StoreConfig(cacheable_pin_fraction=1.0, verified_loads=False),
    "plain": StoreConfig(cacheable_pin_fraction=1.0, speculative_loads=False),
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--n", type=int, default=250)
    ap.add_argument("--form", choices=list(FORMS), default="verified")
    ap.add_argument("--churn-every", type=int, default=1, metavar="K",
                    help="churn the device pool before every K-th resolve only and time the other ones (back to "
                         "back, as the bench's burst arm: warm code, cold data); default 1: after every churn")
    args = ap.parse_args()
    marks: list[tuple[str, float]] = []
    now = time.perf_counter

    def stamp(name: str) -> None:
        marks.append((name, now()))

    def wrap(obj: Any, attr: str, label: str | None = None) -> None:
        fn = getattr(obj, attr)
        label = label or attr

        def timed(*a: Any, **k: Any) -> Any:
            stamp(label + ">")
            try:
                return fn(*a, **k)
            finally:
                stamp(label + "<")

        setattr(obj, attr, timed)

    cs = ClusterStore.start(args.n * args.blocks * 2 * 2 * ARENA_BLOCK + (8 << 20), log_level="warning")
    try:
        model = IpcBenchModel(cs.allocator, max(2048, 4 * args.blocks))
        store = cs.attach_model(model, live_slots=CONCURRENCY, config=FORMS[args.form])
        b = IpcBench(cs, store, model)
        prompts = [b.prompt(args.blocks) for _ in range(args.n)]
        for p in prompts:
            b.seal(p)
        time.sleep(0.5)  # the last commits (fire-and-forget) land: every page is verifiable
        pool = store.pools[0]
        wrap(store._resolver, "begin")
        wrap(pool.hasher, "hash_prompt")
        wrap(pool, "probe")
        wrap(store._resolver, "speculation")
        wrap(store.slot_caches[0], "run", "slot_cache_run")  # speculative / plain forms
        wrap(store.slot_caches[0], "run_verified", "slot_cache_run_verified")  # verified: lookup + first check
        wrap(pool, "reserve_loaded_blocks", "reserve")
        wrap(store.copiers[0], "load_blocking", "load")
        wrap(store.tier, "query_blocking", "query")
        wrap(store._resolver, "keep_verified")
        wrap(store._resolver, "keep_confirmed")
        wrap(pool, "commit_loaded_blocks", "commit")
        check: Callable[..., int] = store_resolve.verified_run

        def timed_check(*a: Any) -> int:
            stamp("check>")
            try:
                return check(*a)
            finally:
                stamp("check<")

        store_resolve.verified_run = timed_check  # type: ignore[assignment]
        wait = direct.DirectCalls._wait

        def timed_wait(self: Any, *a: Any, **k: Any) -> Any:
            stamp("wait>")
            try:
                return wait(self, *a, **k)
            finally:
                stamp("wait<")

        direct.DirectCalls._wait = timed_wait  # type: ignore[method-assign]
        rows: list[list[tuple[str, float]]] = []
        try:
            for i, p in enumerate(prompts):
                churned = i % args.churn_every == 0
                if churned:
                    b.churn()
                marks.clear()
                stamp("start")
                pre = store.resolve_prefix_sync(0, "r", p)
                stamp("done")
                if pre.host_tokens != args.blocks * 16:  # a degrade (e.g. a wrapper broke a call) is not timed
                    raise RuntimeError(f"expected a host hit of {args.blocks} blocks, got {pre}")
                pre.hold.release()
                t0 = marks[0][1]
                if churned and args.churn_every > 1:
                    continue
                rows.append([(name, (t - t0) * 1e6) for name, t in marks])
        finally:
            store_resolve.verified_run = check
            direct.DirectCalls._wait = wait  # type: ignore[method-assign]
            b.close()
    finally:
        cs.close()
    names = [name for name, _ in rows[-1]]
    same = [r for r in rows if [name for name, _ in r] == names]  # resolves that took the same steps
    print(f"# {args.form} blocking resolve of {args.blocks} blocks (churn before every {args.churn_every}): "
          f"{len(same)} of {len(rows)} took these steps; "
          "median us since start, +step")
    prev = 0.0
    for i, name in enumerate(names):
        med = statistics.median(r[i][1] for r in same)
        print(f"{name:24s} {med:8.1f}  +{med - prev:7.1f}")
        prev = med
    return 0


if __name__ == "__main__":
    sys.exit(main())
