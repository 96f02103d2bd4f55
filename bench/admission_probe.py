"""Eviction candidates of issue 35 measured after ARC and depth-cost, all dropped (bench/RESULTS.md, "Trace replay"):
admission (a missed block enters the cache only if admitted, else it bypasses: a host tier may decline a save, a
device pool may not), Belady with bypass (the bound an admitting policy is held to), a prefix-sharing weight, a
session-gap weight, an offline-fitted hazard table (a ceiling for what those features can tell), and a one-bit future oracle (does this
request's conversation come back soon) to size what the features miss. Same reference
model as `kvproc bench replay --capacity` (kvproc/bench/eviction_sim.py: 512-token blocks, no resident prompt, token
hit ratio), plus the one thing that model cannot express: a bypass.

Chain rule (every admitting candidate): a request's hit is its leading run of present blocks, so once one of its
missed blocks bypasses, every later missed block of that request bypasses too (admitting block k+1 without k buys
nothing).

Usage: .venv/bin/python bench/admission_probe.py conversation|synthetic[:first:end] 'cand1,cand2,...'
A candidate is `kind[:param=value;...]`: `admit:slack=0.25`, `admit:window=0.01`, `tinylfu:window=0.01`,
`boost:fan=1`, `boost:gap=0.5`, `hazard:gap=1;length=1`, `belady-bypass`, `oracle:within=600;bonus=8`. Prints token hit at 1e6 / 3e6 / 1e7.
Per-block dict/heap code: a probe, not a policy.
"""

from __future__ import annotations

import heapq
import math
import sys
from collections import OrderedDict
from typing import Any

from kvproc.bench.eviction_sim import next_uses
from kvproc.bench.replay import DEFAULT_TRACE, TraceRequest, load_trace
from kvproc.bench.synthetic_trace import synthetic_trace


class Lrfu:
    """lrfu with exact history (the sketch's ideal; equal to the shipped sketch to 4 digits, RESULTS): priority of a
    block = log2(sum over its uses of 2**(t_use / half_life)), min evicted first, ties to the earliest insert."""

    def __init__(self, half_life: float = 300.0) -> None:
        self.lam = 1.0 / half_life
        self.v: dict[int, float] = {}
        self.heap: list[tuple[float, int, int]] = []
        self.key: dict[int, tuple[float, int]] = {}  # cached block -> its live (priority, seq)
        self.seq = 0
        self.now = 0.0

    def count(self, b: int) -> float:
        """Record one use of b now (whether or not it is cached); its priority after it."""
        self.v[b] = self.v.get(b, 0.0) + 2.0 ** (self.lam * self.now)
        return math.log2(self.v[b])

    def put(self, b: int, p: float) -> None:
        self.seq += 1
        self.key[b] = (p, self.seq)
        heapq.heappush(self.heap, (p, self.seq, b))

    def peek(self) -> tuple[float, int]:
        heap, key = self.heap, self.key
        while True:
            p, s, b = heap[0]
            if key.get(b) == (p, s):
                return p, b
            heapq.heappop(heap)

    def evict(self) -> int:
        _p, b = self.peek()
        heapq.heappop(self.heap)
        del self.key[b]
        return b

    def __contains__(self, b: int) -> bool:
        return b in self.key

    def __len__(self) -> int:
        return len(self.key)


def run_admit(trace: list[TraceRequest], cap: int, half_life: float = 300.0, slack: float = 0.0,
              window: float = 0.0, min_uses: float = 0.0) -> float:
    """lrfu eviction + TinyLFU-style admission. A missed block b, cache full: admitted iff its priority (this use
    counted) exceeds the main victim's by more than `slack` (log2 units) and its decayed use count is >= `min_uses`.
    With `window` > 0, a fraction of the capacity is an LRU window every missed block enters unconditionally; the
    window's LRU block then goes to the main cache only if admitted (else it is dropped), so a fresh conversation's
    next turn can still hit while it is in the window."""
    main = Lrfu(half_life)
    wcap = int(cap * window)
    mcap = cap - wcap
    win: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    lam = main.lam
    for r in trace:
        main.now = now = r.timestamp / 1000.0
        ids = r.hash_ids
        h = 0
        while h < len(ids) and (ids[h] in main or ids[h] in win):
            h += 1
        hit += min(h * 512, r.input_length)
        total += r.input_length
        refused = False
        for b in ids:
            p = main.count(b)
            if b in main:
                main.put(b, p)
                continue
            if b in win:
                win.move_to_end(b)
                continue
            if refused:
                continue
            if wcap:
                win[b] = None
                if len(win) <= wcap:
                    continue
                c, _ = win.popitem(last=False)  # the window's oldest goes to the main cache if admitted
                pc = math.log2(main.v[c])
            else:
                c, pc = b, p
            if len(main) < mcap:
                main.put(c, pc)
                continue
            vp, _v = main.peek()
            if pc > vp + slack and pc - lam * now >= math.log2(max(min_uses, 1e-300)):
                main.evict()
                main.put(c, pc)
            elif not wcap:
                refused = True  # chain rule: the rest of this request's missed blocks bypass too
    return hit / total


def run_belady_bypass(trace: list[TraceRequest], cap: int, nu: list[list[float]]) -> float:
    """Belady with bypass: a missed block whose next use is at least as far as the furthest cached block's is not
    inserted (the recorded Belady must insert every missed block). Chain rule as for the online candidates."""
    key: dict[int, tuple[float, int]] = {}
    heap: list[tuple[tuple[float, int], int]] = []
    seq = hit = total = 0
    for i, r in enumerate(trace):
        ids = r.hash_ids
        h = 0
        while h < len(ids) and ids[h] in key:
            h += 1
        hit += min(h * 512, r.input_length)
        total += r.input_length
        refused = False
        for j, b in enumerate(ids):
            seq += 1
            k = (-nu[i][j], seq)
            if b not in key:
                if refused:
                    continue
                if len(key) >= cap:
                    while True:
                        top, victim = heap[0]
                        if key.get(victim) == top:
                            break
                        heapq.heappop(heap)
                    if -top[0] <= nu[i][j]:  # the victim comes back no later than b: keep it, b bypasses
                        refused = True
                        continue
                    heapq.heappop(heap)
                    del key[victim]
            key[b] = k
            heapq.heappush(heap, (k, b))
        if len(heap) > 4 * len(key) + 4096:
            heap = [(k, b) for k, b in heap if key.get(b) == k]
            heapq.heapify(heap)
    return hit / total


def parse(spec: str) -> tuple[str, dict[str, float]]:
    kind, _, rest = spec.partition(":")
    args = {k: float(v) for k, v in (kv.split("=") for kv in rest.split(";") if kv)}
    return kind, args


def run_tinylfu(trace: list[TraceRequest], cap: int, window: float = 0.01, freq_half_life: float = 300.0,
                chain: float = 1.0, ge: float = 0.0) -> float:
    """W-TinyLFU: an LRU window (`window` x capacity) every missed block enters; the window's oldest block then
    enters the main LRU only if its decayed use count (half-life `freq_half_life`, exact history) beats the main
    LRU victim's (>= with `ge`), else it is dropped. With `chain`, a candidate whose parent block (the one before it
    in the request that brought it) is not cached is dropped too."""
    lam = 0.0 if math.isinf(freq_half_life) else 1.0 / freq_half_life
    v: dict[int, float] = {}
    parent: dict[int, int] = {}
    wcap = max(int(cap * window), 1)
    mcap = cap - wcap
    win: OrderedDict[int, None] = OrderedDict()
    main: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for r in trace:
        now = r.timestamp / 1000.0
        w = 2.0 ** (lam * now)
        ids = r.hash_ids
        h = 0
        while h < len(ids) and (ids[h] in main or ids[h] in win):
            h += 1
        hit += min(h * 512, r.input_length)
        total += r.input_length
        prev = -1
        for b in ids:
            v[b] = v.get(b, 0.0) + w
            if b in main:
                main.move_to_end(b)
            elif b in win:
                win.move_to_end(b)
            else:
                parent[b] = prev
                win[b] = None
                if len(win) > wcap:
                    c, _ = win.popitem(last=False)
                    if len(main) < mcap:
                        main[c] = None
                    else:
                        vic = next(iter(main))
                        p = parent.get(c, -1)
                        ok = v[c] >= v[vic] if ge else v[c] > v[vic]
                        if chain and p >= 0 and p not in main and p not in win:
                            ok = False
                        if ok:
                            del main[vic]
                            main[c] = None
            prev = b
    return hit / total


def run_boosted(trace: list[TraceRequest], cap: int, half_life: float = 300.0, fan: float = 0.0, gap: float = 0.0,
                g0: float = 300.0, gfirst: float = 600.0, slack: float = -1e9, new: float = 0.0,
                n0: float = 8.0) -> float:
    """lrfu + bonuses on the log2 priority: `fan` x log2(1 + distinct successor blocks seen after this block) (the
    prefix-sharing weight: how many distinct continuations share this prefix); `gap` x log2(g0 / g), g = this
    request's session gap (seconds since the deepest block of this request seen before was last used; `gfirst` for
    a first turn): sessions that come back quickly keep their blocks longer; `new` x log2(n0 / n), n = the request's
    blocks past the deepest one seen before (a short new turn: a conversation more likely to come back soon, the
    best single predictor of that measured). With `slack` > -1e9, admission as in
    `run_admit` (chain rule)."""
    main = Lrfu(half_life)
    succ: dict[int, set[int]] = {}
    last: dict[int, float] = {}
    hit = total = 0
    for r in trace:
        main.now = now = r.timestamp / 1000.0
        ids = r.hash_ids
        h = 0
        while h < len(ids) and ids[h] in main:
            h += 1
        hit += min(h * 512, r.input_length)
        total += r.input_length
        bonus = 0.0
        if gap or new:
            seen = [(j, last[b]) for j, b in enumerate(ids[1:]) if b in last]
            g = max(now - seen[-1][1], 1.0) if seen else gfirst
            n = len(ids) - 1 - (seen[-1][0] + 1 if seen else 0)
            bonus = gap * math.log2(g0 / g) + new * math.log2(n0 / max(n, 1))
        refused = False
        prev = -1
        for b in ids:
            if fan and prev >= 0:
                succ.setdefault(prev, set()).add(b)
            prev = b
            last[b] = now
            p = main.count(b) + bonus
            if fan:
                p += fan * math.log2(1 + len(succ.get(b, ())))
            if b in main:
                main.put(b, p)
                continue
            if refused:
                continue
            if len(main) < cap:
                main.put(b, p)
                continue
            vp, _v = main.peek()
            if p > vp + slack:
                main.evict()
                main.put(b, p)
            else:
                refused = True
    return hit / total


def run_hazard(trace: list[TraceRequest], cap: int, horizon: float = 300.0, gap: float = 0.0,
               length: float = 0.0, new: float = 0.0) -> float:
    """A ceiling for what frequency, recency and session features can tell, not an online policy: per-class reuse
    hazards fitted OFFLINE on the whole trace being replayed (so it sees the trace's statistics in advance), then
    eviction of the block least likely to be used again within `horizon` seconds given its class and age (one LRU
    list per class; the candidates are each list's oldest). Class = use count so far (1, 2, 3, 4, 5-6, 7-10, 11+),
    x with `gap` the session gap of the request that last used it (first turn, <16, 16-64, 64-256, 256-1024,
    1024+ s), x with `length` that request's blocks (<8, 8-15, 16-31, 32+), x with `new` its blocks past the deepest
    one seen before (its new turn: <4, 4-7, 8-15, 16+). Age buckets are powers of two seconds."""
    nb = 16
    ucs = (1, 2, 3, 4, 6, 10)
    times = [r.timestamp / 1000.0 for r in trace]
    sess: list[float | None] = []
    fresh: list[int] = []
    seen: dict[int, float] = {}
    for i, r in enumerate(trace):
        g, deep = None, 0
        for j, b in enumerate(r.hash_ids[1:]):
            if b in seen:
                g, deep = times[i] - seen[b], j + 1
        sess.append(g)
        fresh.append(len(r.hash_ids) - 1 - deep)
        for b in r.hash_ids:
            seen[b] = times[i]

    def cls(uses: int, i: int) -> int:
        k = sum(uses > t for t in ucs)
        if gap:
            g = sess[i]
            k = k * 6 + (0 if g is None else 1 + min(4, max(0, int(math.log2(max(g, 1.0)) // 2) - 2)))
        if length:
            k = k * 4 + min(3, max(0, int(math.log2(len(trace[i].hash_ids))) - 2))
        if new:
            k = k * 4 + min(3, max(0, int(math.log2(max(fresh[i], 1))) - 1))
        return k

    ncls = (len(ucs) + 1) * (6 if gap else 1) * (4 if length else 1) * (4 if new else 1)

    def bucket(a: float) -> int:
        return min(nb - 1, max(0, int(math.log2(max(a, 1.0)))))

    nxt: list[list[float]] = [[] for _ in trace]
    last_t: dict[int, float] = {}
    for i in range(len(trace) - 1, -1, -1):
        nxt[i] = [last_t.get(b, math.inf) for b in trace[i].hash_ids]
        for b in trace[i].hash_ids:
            last_t[b] = times[i]
    reuse = [[0.0] * nb for _ in range(ncls)]
    expo = [[0.0] * nb for _ in range(ncls)]
    uses: dict[int, int] = {}
    end_t = times[-1]
    for i, r in enumerate(trace):
        for j, b in enumerate(r.hash_ids):
            uses[b] = uses.get(b, 0) + 1
            c = cls(uses[b], i)
            g = nxt[i][j] - times[i]
            end = min(g, end_t - times[i])
            for k in range(bucket(end) + 1):
                expo[c][k] += max(0.0, min(end, 2.0 ** (k + 1)) - (0.0 if k == 0 else 2.0 ** k))
            if not math.isinf(g):
                reuse[c][bucket(g)] += 1
    edges = [0.0] + [2.0 ** (k + 1) for k in range(nb)]
    haz = [[reuse[c][k] / max(expo[c][k], 1e-9) for k in range(nb)] for c in range(ncls)]
    cum = [[0.0] for _ in range(ncls)]
    for c in range(ncls):
        for k in range(nb):
            cum[c].append(cum[c][-1] + haz[c][k] * (edges[k + 1] - edges[k]))

    def H(c: int, a: float) -> float:  # cumulative hazard from age 0 to a
        if a >= edges[-1]:
            return cum[c][-1]
        k = 0 if a < 2 else int(math.log2(a))
        return cum[c][k] + haz[c][k] * (a - edges[k])

    lists: list[OrderedDict[int, float]] = [OrderedDict() for _ in range(ncls)]
    where: dict[int, int] = {}
    uses = {}
    hit = total = 0
    for i, r in enumerate(trace):
        now, ids = times[i], r.hash_ids
        h = 0
        while h < len(ids) and ids[h] in where:
            h += 1
        hit += min(h * 512, r.input_length)
        total += r.input_length
        for b in reversed(ids):  # tail first: within a class the tail is older, so it goes first
            uses[b] = uses.get(b, 0) + 1
            c = cls(uses[b], i)
            if b in where:
                del lists[where[b]][b]
            elif len(where) >= cap:
                best: tuple[float, int, int] | None = None
                for k, lst in enumerate(lists):
                    if lst:
                        v, t = next(iter(lst.items()))
                        val = H(k, now - t + horizon) - H(k, now - t)
                        if best is None or val < best[0]:
                            best = (val, k, v)
                assert best is not None
                del lists[best[1]][best[2]]
                del where[best[2]]
            lists[c][b] = now
            where[b] = c
    return hit / total

def run_return_oracle(trace: list[TraceRequest], cap: int, within: float = 600.0, bonus: float = 8.0,
                      noise: float = 0.0) -> float:
    """Not online: lrfu, plus `bonus` (log2 units, 1 = one half-life of recency) on every block of a request whose
    own prompt comes back (its last full block is used again) within `within` seconds. One future bit per request:
    how much of Belady's lead is the bit "this conversation returns soon", which no feature above predicts. With
    `noise`, each request's bit is flipped with that probability (seeded): how good a predictor of it must be."""
    import random

    flip = random.Random(0)
    times = [r.timestamp / 1000.0 for r in trace]
    nxt_t: list[float] = []
    last: dict[int, float] = {}
    for i in range(len(trace) - 1, -1, -1):
        ids = trace[i].hash_ids
        b = ids[-2] if len(ids) > 1 else ids[-1]
        nxt_t.append(last.get(b, math.inf) - times[i])
        for x in ids:
            last[x] = times[i]
    nxt_t.reverse()
    main = Lrfu()
    hit = total = 0
    for i, r in enumerate(trace):
        main.now = times[i]
        ids = r.hash_ids
        h = 0
        while h < len(ids) and ids[h] in main:
            h += 1
        hit += min(h * 512, r.input_length)
        total += r.input_length
        extra = bonus if (nxt_t[i] <= within) != (flip.random() < noise) else 0.0
        for b in ids:
            p = main.count(b) + extra
            if b not in main and len(main) >= cap:
                main.evict()
            main.put(b, p)
    return hit / total

if __name__ == "__main__":
    which = sys.argv[1] if len(sys.argv) > 1 else "conversation"
    name, *cut = which.split(":")  # conversation:0:6000 replays that slice of requests (a held-out half)
    trace = load_trace(DEFAULT_TRACE) if name == "conversation" else synthetic_trace()
    if cut:
        trace = trace[int(cut[0]):int(cut[1])]
    caps = [int(c) // 512 for c in (1e6, 3e6, 1e7)]
    nu: Any = None
    for spec in sys.argv[2].split(","):
        kind, args = parse(spec)
        if kind == "oracle":
            out = [run_return_oracle(trace, c, **args) for c in caps]
        elif kind == "hazard":
            out = [run_hazard(trace, c, **args) for c in caps]
        elif kind == "boost":
            out = [run_boosted(trace, c, **args) for c in caps]
        elif kind == "tinylfu":
            out = [run_tinylfu(trace, c, **args) for c in caps]
        elif kind == "belady-bypass":
            nu = nu or next_uses(trace)
            out = [run_belady_bypass(trace, c, nu) for c in caps]
        else:
            out = [run_admit(trace, c, **args) for c in caps]
        print(which, spec, " ".join(f"{x:.4f}" for x in out), flush=True)
