"""The eviction reference model of `kvproc bench replay --capacity ... --policy ...` (issue 35's definition).

Unit: one 512-token trace block (a trace hash id) is one cache entry; capacity C tokens hold C // 512 blocks.
Requests go one at a time in trace order. A request's hit is its leading run of blocks present when it arrives
(hit tokens: min(hit blocks * 512, input_length)); then each of its blocks is accessed head to tail: a present block
is used again (`remove` + `insert`: one use), an absent one is inserted after evicting one victim if the cache is
full. A request's own prompt is NOT held resident while it runs: a later block of a long prompt may evict an earlier
one (a pure cache simulation, as the issue's 0.254 / 0.357 / 0.374 Belady figures were computed; kvproc's device
pool holds a running prompt, `replay(...)` measures that).

The online policies are the shipped ones (`kvproc.core.eviction.make_policy`) driven through their protocol on slot
ids, with the block id as the content fingerprint and the trace's timestamp (seconds) as the clock. Belady is offline:
evict the block whose next use is furthest in the future (never used again: infinitely far); ties go to the least
recently accessed block. It cannot bypass (every missed block is inserted); Belady with bypass was measured and is
worth +0.0003 at most here, so this bound holds for admitting policies too (bench/RESULTS.md, "Trace replay").
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvproc.core.eviction import make_policy

if TYPE_CHECKING:
    from kvproc.bench.replay import TraceRequest

TRACE_BLOCK = 512


@dataclass(frozen=True)
class PolicyResult:
    policy: str
    capacity_tokens: float
    block_hit_ratio: float
    token_hit_ratio: float
    prefill_tokens_saved: int
    evictions: int


def next_uses(trace: list[TraceRequest]) -> list[list[float]]:
    """For each request and block position: the index of the next request that holds that block (inf: none)."""
    last: dict[int, float] = {}
    out: list[list[float]] = [[] for _ in trace]
    for i in range(len(trace) - 1, -1, -1):
        ids = trace[i].hash_ids
        out[i] = [last.get(b, math.inf) for b in ids]
        for b in ids:
            last[b] = i
    return out


def simulate(trace: list[TraceRequest], capacity_tokens: float, policy: str, *, half_life: float = 300.0,
             nu: list[list[float]] | None = None) -> PolicyResult:
    cap = len({b for r in trace for b in r.hash_ids}) if math.isinf(capacity_tokens) else int(capacity_tokens) // TRACE_BLOCK
    cap = max(cap, 1)
    if policy == "belady":
        return _belady(trace, capacity_tokens, cap, nu if nu is not None else next_uses(trace))
    now = [0.0]
    pol = make_policy(policy, cap, half_life=half_life, clock=lambda: now[0])
    slot_of: dict[int, int] = {}
    block_of = [0] * cap
    free = list(range(cap - 1, -1, -1))
    bind = getattr(pol, "bind_fingerprints", None)
    hit_blocks = total_blocks = hit_tokens = input_tokens = evictions = 0
    for req in trace:
        now[0] = req.timestamp / 1000.0
        ids = req.hash_ids
        h = 0
        while h < len(ids) and ids[h] in slot_of:
            h += 1
        hit_blocks += h
        total_blocks += len(ids)
        hit_tokens += min(h * TRACE_BLOCK, req.input_length)
        input_tokens += req.input_length
        for b in ids:
            s = slot_of.get(b)
            if s is not None:
                pol.remove([s])
                pol.insert([s])
                continue
            if free:
                s = free.pop()
            else:
                s = pol.pop_oldest(1)[0]
                del slot_of[block_of[s]]
                evictions += 1
            slot_of[b] = s
            block_of[s] = b
            if bind is not None:
                bind([s], np.array([b], dtype=np.uint64))
            pol.insert([s])
    return PolicyResult(policy, capacity_tokens, hit_blocks / max(total_blocks, 1),
                        hit_tokens / max(input_tokens, 1), hit_tokens, evictions)


def _belady(trace: list[TraceRequest], capacity_tokens: float, cap: int, nu: list[list[float]]) -> PolicyResult:
    key: dict[int, tuple[float, int]] = {}  # block -> its live heap key (-next use, access seq)
    heap: list[tuple[tuple[float, int], int]] = []
    seq = hit_blocks = total_blocks = hit_tokens = input_tokens = evictions = 0
    for i, req in enumerate(trace):
        ids = req.hash_ids
        h = 0
        while h < len(ids) and ids[h] in key:
            h += 1
        hit_blocks += h
        total_blocks += len(ids)
        hit_tokens += min(h * TRACE_BLOCK, req.input_length)
        input_tokens += req.input_length
        for j, b in enumerate(ids):
            if b not in key and len(key) >= cap:
                while True:
                    k, victim = heapq.heappop(heap)
                    if key.get(victim) == k:
                        del key[victim]
                        evictions += 1
                        break
            seq += 1
            k = (-nu[i][j], seq)
            key[b] = k
            heapq.heappush(heap, (k, b))
        if len(heap) > 4 * len(key) + 4096:
            heap = [(k, b) for k, b in heap if key.get(b) == k]
            heapq.heapify(heap)
    return PolicyResult("belady", capacity_tokens, hit_blocks / max(total_blocks, 1),
                        hit_tokens / max(input_tokens, 1), hit_tokens, evictions)


def compare(traces: dict[str, list[TraceRequest]], capacities: list[float], policies: list[str], *,
            half_life: float = 300.0) -> list[dict[str, object]]:
    """Every (trace, capacity, policy), each row with its fraction of Belady's token hit ratio (Belady is always run:
    it is the bound the fractions are of)."""
    rows: list[dict[str, object]] = []
    for name, trace in traces.items():
        nu = next_uses(trace)
        for cap in capacities:
            bound = simulate(trace, cap, "belady", nu=nu)
            for p in policies:
                r = bound if p == "belady" else simulate(trace, cap, p, half_life=half_life, nu=nu)
                rows.append({"trace": name, "capacity_tokens": cap, "policy": p,
                             "block_hit_ratio": r.block_hit_ratio, "token_hit_ratio": r.token_hit_ratio,
                             "of_belady": r.token_hit_ratio / bound.token_hit_ratio if bound.token_hit_ratio else 0.0,
                             "prefill_tokens_saved": r.prefill_tokens_saved, "evictions": r.evictions})
    return rows


def format_rows(rows: list[dict[str, object]]) -> str:
    w = max([7, *(len(str(r["policy"])) for r in rows)])
    lines = [f"{'trace':<13} {'capacity':>9} {'policy':<{w}} {'block hit':>9} {'token hit':>9} {'x Belady':>8} "
             f"{'prefill saved':>14}"]
    for r in rows:
        lines.append(f"{r['trace']:<13} {r['capacity_tokens']:>9.0e} {r['policy']:<{w}} {r['block_hit_ratio']:>9.4f} "
                     f"{r['token_hit_ratio']:>9.4f} {r['of_belady']:>8.3f} {r['prefill_tokens_saved']:>14,}")
    return "\n".join(lines)
