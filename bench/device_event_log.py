"""A device pool's KV events, the compiled log (`EventLog`, now) against the queued records it replaced (the tree at
`--base`: `DeviceIndexEvents` queueing a tuple per change, its C batch writer), A/B in one run, both sides' costs:

- the path: what the pool's listener costs a resolve under the pool's lock (one registration of `--pages` pages of
  16 tokens, with its parent, and one removal of as many evicted keys), in ns per resolve;
- the thread: what the publisher's thread spends turning `--resolves` resolves' changes into one batch's payload
  (records: take them from the queue, write, free them; log: `take`), thread CPU per batch.

The prompts cycle through `--prompts` distinct ones so that their keys and tokens are as cold as in place. Two forms
of a registration's token ids: a restore's (the prompt as its hash packed it: little-endian uint32 bytes) and a
computed page's (a view of the request's int64 array). The arms run interleaved, their order rotating, for
`--rounds` rounds; printed: each arm's median, and the median over rounds of each round's log / records ratio.

    .venv/bin/python bench/device_event_log.py [--base 156b8d3] [--rounds 40] [--resolves 200] [--pages 16]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import statistics
import sys
import tempfile
import time
import types
from typing import Any

import numpy as np
from base_tree import module_at, native_at

from kvproc.core.hashing import PAD_TOKEN_ID
from kvproc.native import NATIVE
from kvproc.tiers.kv_events import MEDIUM_DEVICE

PAGE = 16


def build_base(rev: str, tmp: str) -> types.ModuleType:
    """`rev`'s `tiers/device_index_events.py`, wired to `rev`'s compiled helpers (built here into `tmp`)."""
    return module_at(rev, "kvproc/tiers/device_index_events.py", tmp, native_at(rev, tmp))


class QueuePublisher:
    """The records' side of `KvEventPublisher` without a socket: its queue, taken as its thread takes it."""

    def __init__(self) -> None:
        self.q: collections.deque[Any] = collections.deque()
        self.put = self.q.append
        self.encode_batch: Any = None

    def publish(self, events: list[Any]) -> None:
        self.q.extend(events)

    def batch(self) -> bytes:
        q = self.q
        items = list(itertools.starmap(q.popleft, itertools.repeat((), len(q))))
        payload: bytes = self.encode_batch(1.0, items)
        del items  # the records' frees: the thread's too
        return payload


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", default="156b8d3", help="the tree with the queued records (a git revision)")
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--resolves", type=int, default=200, help="resolves per batch (200: a 50 ms interval at 4,000/s)")
    ap.add_argument("--pages", type=int, default=16)
    ap.add_argument("--prompts", type=int, default=4000)
    args = ap.parse_args()
    if NATIVE is None:
        print("the compiled helpers are not built (or KVPROC_PURE_PYTHON=1): nothing to compare", file=sys.stderr)
        return 2
    P, K = args.pages, args.resolves
    rng = np.random.default_rng(0)
    keys = [[rng.bytes(16) for _ in range(P)] for _ in range(args.prompts)]
    evicted = [[rng.bytes(16) for _ in range(P)] for _ in range(args.prompts)]
    parents = [rng.bytes(16) for _ in range(args.prompts)]
    ids = rng.integers(0, 150_000, size=(args.prompts, P * PAGE))
    packed = [row.astype("<u4").tobytes() for row in ids]
    arrays = [row.astype(np.int64) for row in ids]
    positions = list(range(P))
    with tempfile.TemporaryDirectory(prefix="kvproc-evlog-") as tmp:
        base = build_base(args.base, tmp)
        qpub = QueuePublisher()
        records = base.DeviceIndexEvents(qpub, PAGE)
        log = NATIVE.EventLog(PAGE, MEDIUM_DEVICE, PAD_TOKEN_ID, 1 << 30)
        at = [0]

        def arm(listener: Any, batch: Any, tokens: list[Any]) -> tuple[float, float]:
            t0 = time.perf_counter_ns()
            for _ in range(K):
                i = at[0] % args.prompts
                at[0] += 1
                tok = tokens[i]
                listener.stored(keys[i], positions, tok if type(tok) is bytes else tok[:], 0, parents[i])
                listener.removed(evicted[i])
            path = (time.perf_counter_ns() - t0) / K
            t1 = time.thread_time_ns()
            batch()
            return path, (time.thread_time_ns() - t1) / 1e3

        arms = {
            "records, packed tokens": lambda: arm(records, qpub.batch, packed),
            "log, packed tokens": lambda: arm(log, lambda: log.take(1.0), packed),
            "records, int64 tokens": lambda: arm(records, qpub.batch, arrays),
            "log, int64 tokens": lambda: arm(log, lambda: log.take(1.0), arrays),
        }
        times: dict[str, list[tuple[float, float]]] = {k: [] for k in arms}
        names = list(arms)
        for name in names:  # warm: buffers grown, code paged in
            arms[name]()
        for r in range(args.rounds):
            if sys.stderr.isatty():
                print(f"\r  round {r}/{args.rounds}", end="", file=sys.stderr, flush=True)
            for k in names[r % len(names):] + names[: r % len(names)]:
                times[k].append(arms[k]())
    print(f"\n{P} pages of {PAGE} tokens per resolve (one registration, one removal of {P} keys), {K} resolves per "
          f"batch, {args.prompts} prompts cycled, {args.rounds} rounds; base {args.base}")
    for form in ("packed", "int64"):
        rec, lg = times[f"records, {form} tokens"], times[f"log, {form} tokens"]
        for what, j, unit in (("path, ns per resolve", 0, "ns"), ("thread, us per batch", 1, "us")):
            a, b = statistics.median(x[j] for x in rec), statistics.median(x[j] for x in lg)
            paired = statistics.median(y[j] / x[j] for x, y in zip(rec, lg))
            print(f"  {form:6s} tokens, {what}: records {a:8.1f} {unit}, log {b:8.1f} {unit}; log / records: "
                  f"{b / a:.3f}x (paired by round {paired:.3f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
