"""Eviction candidates issue 35 measured and dropped (not shipped): SLRU (2Q-like), LFU with dynamic aging (LFUDA),
and LRFU without history, in the same reference model as
`kvproc bench replay --capacity` (512-token blocks, no resident prompt, token hit ratio; kvproc/bench/eviction_sim.py);
and two lrfu variants: exact history (the sketch's ideal) and depth-weighted cost-aware priorities.

Usage: .venv/bin/python bench/eviction_candidates_probe.py [conversation|synthetic] [candidate,...]
Prints each candidate's token hit ratio at 1e6 / 3e6 / 1e7 tokens. Per-block dict/heap code: a probe, not a policy.
"""

from __future__ import annotations

import heapq
import math
import sys
from collections import OrderedDict
from typing import Any

from kvproc.bench.replay import DEFAULT_TRACE, TraceRequest, load_trace
from kvproc.bench.synthetic_trace import synthetic_trace


def run(trace: list[TraceRequest], cap_tokens: float, pol: Any) -> float:
    cap = int(cap_tokens) // 512
    present: set[int] = set()
    hit = total = 0
    for r in trace:
        ids = r.hash_ids
        h = 0
        while h < len(ids) and ids[h] in present:
            h += 1
        hit += min(h * 512, r.input_length)
        total += r.input_length
        pol.begin(ids, h, r.timestamp / 1000.0)
        for b in ids:
            if b in present:
                pol.touch(b)
                continue
            if len(present) >= cap:
                present.discard(pol.victim())
            present.add(b)
            pol.add(b)
    return hit / total


class Slru:
    """Blocks seen once in a probation LRU, evicted before the protected LRU of blocks used again."""

    def __init__(self) -> None:
        self.prob: OrderedDict[int, None] = OrderedDict()
        self.prot: OrderedDict[int, None] = OrderedDict()

    def begin(self, ids: Any, h: int, now: float) -> None:
        pass

    def touch(self, b: int) -> None:
        self.prob.pop(b, None)
        self.prot.pop(b, None)
        self.prot[b] = None

    def add(self, b: int) -> None:
        self.prob[b] = None

    def victim(self) -> int:
        return (self.prob if self.prob else self.prot).popitem(last=False)[0]


class HeapPolicy:
    def __init__(self) -> None:
        self.heap: list[tuple[tuple[float, int], int]] = []
        self.key: dict[int, tuple[float, int]] = {}
        self.seq = 0

    def push(self, b: int, k: float) -> None:
        self.seq += 1
        self.key[b] = (k, self.seq)
        heapq.heappush(self.heap, (self.key[b], b))

    def victim(self) -> int:
        while True:
            k, b = heapq.heappop(self.heap)
            if self.key.get(b) == k:
                del self.key[b]
                self.evicted(b, k)
                return b

    def evicted(self, b: int, k: tuple[float, int]) -> None:
        pass


class Lfuda(HeapPolicy):
    """LFU with dynamic aging: priority = L + count, L = the last victim's priority; counts kept across evictions."""

    def __init__(self) -> None:
        super().__init__()
        self.L = 0.0
        self.f: dict[int, int] = {}

    def begin(self, ids: Any, h: int, now: float) -> None:
        pass

    def touch(self, b: int) -> None:
        self.f[b] = self.f.get(b, 0) + 1
        self.push(b, self.L + self.f[b])

    add = touch

    def evicted(self, b: int, k: tuple[float, int]) -> None:
        self.L = k[0]


class LrfuNoHistory(HeapPolicy):
    """The shipped lrfu's score (half-life 300 s) but forgotten at eviction (no sketch)."""

    def __init__(self, half_life: float = 300.0) -> None:
        super().__init__()
        self.lam = 1.0 / half_life
        self.v: dict[int, float] = {}
        self.now = 0.0

    def begin(self, ids: Any, h: int, now: float) -> None:
        self.now = now

    def touch(self, b: int) -> None:
        self.v[b] = self.v.get(b, 0.0) + 2.0 ** (self.lam * self.now)
        self.push(b, math.log2(self.v[b]))

    add = touch

    def evicted(self, b: int, k: tuple[float, int]) -> None:
        del self.v[b]


class LrfuExact(HeapPolicy):
    """The shipped lrfu's score (half-life 300 s) with exact history (a dict of every block ever seen, never
    forgotten: the sketch's ideal), the baseline of the depth-weighted variant below."""

    def __init__(self, half_life: float = 300.0) -> None:
        super().__init__()
        self.lam = 1.0 / half_life
        self.v: dict[int, float] = {}
        self.depth: dict[int, int] = {}
        self.now = 0.0

    def begin(self, ids: Any, h: int, now: float) -> None:
        self.now = now
        self.depth.update(zip(ids, range(len(ids))))

    def priority(self, b: int) -> float:
        return math.log2(self.v[b])

    def touch(self, b: int) -> None:
        self.v[b] = self.v.get(b, 0.0) + 2.0 ** (self.lam * self.now)
        self.push(b, self.priority(b))

    add = touch


class LrfuDepthCost(LrfuExact):
    """Cost-aware lrfu: expected reuse x what losing the block costs to recompute. Prefill of the block at depth d
    (512-token blocks) attends over d blocks before it: cost ~ C0 + d, C0 = 8 blocks (where the MLP's share equals
    attention's, roughly, at 4k tokens). Priority = log2(decayed count) + log2(C0 + d): deep blocks are kept longer."""

    C0 = 8.0

    def priority(self, b: int) -> float:
        return math.log2(self.v[b]) + math.log2(self.C0 + self.depth[b])


CANDIDATES = {"slru": Slru, "lfuda": Lfuda, "lrfu-nohistory": LrfuNoHistory, "lrfu-exact": LrfuExact,
              "lrfu-depth-cost": LrfuDepthCost}

if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "conversation"
    trace = load_trace(DEFAULT_TRACE) if which == "conversation" else synthetic_trace()
    names = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CANDIDATES)
    for name, cls in ((n, CANDIDATES[n]) for n in names):
        print(which, name, [round(run(trace, c, cls()), 4) for c in (1e6, 3e6, 1e7)], flush=True)
