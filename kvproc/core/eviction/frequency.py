"""Frequency + recency eviction (LRFU): evict the id whose exponentially decayed use count is lowest.

Score of a page = sum over its uses of 2**(-(now - t_use) / half_life). half_life -> infinity is LFU; a short
half-life is LRU. Ties (equal scores) go in insertion order, so a request's tail (inserted first) goes before its
head. With `history` the score is kept by content key in a count-min sketch (`sketch.py`) and survives the page's
eviction (a conversation whose prefix was evicted and recomputed keeps its count); without it a score starts again
at one use when an id is filled.

A retention hint (`insert(ids, retain_s=R)`) raises the inserted pages' queued priority by R / half_life: see
`insert`.

On a prefix chain the score is monotone: a page is used whenever any page below it is, so a parent's score is at
least its child's and a leaf goes first (up to sketch over-estimates), which is what keeps a cached prefix
contiguous (a hit needs every page before it).

Cost: one *run* per insert, not one heap entry per id. A release inserts a request's pages together; their
priorities are sorted once (numpy) into a run, and a heap holds each run's head (score, seq, run): eviction is a
k-way merge of the runs, which pops ids in exactly the (score, seq) order one heap of every id would. An insert is
O(k log k) in C and one heap push; an eviction pops heads (O(log runs) each) and takes, in one vectorised slice, the
run's ids that come before the next run's head. Removal is lazy: an id is live in a run iff `stamp[id] == seq`; stale
entries are skipped when eviction reaches them and dropped by a compaction when they outnumber live ones 4:1.
"""

from __future__ import annotations

import heapq
import math
import time
from typing import Callable, Iterator, Sequence

import numpy as np

from kvproc.core.eviction.sketch import DecayedSketch


class FrequencyRecency:
    def __init__(self, capacity: int, *, half_life: float = 300.0, history: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stamp = np.full(capacity, -1, dtype=np.int64)
        self.wants_keys = history
        self.clock = clock
        self.lam = 0.0 if math.isinf(half_life) else 1.0 / half_life
        self.sketch = DecayedSketch(capacity, half_life) if history else None
        self.fp = np.zeros(capacity, dtype=np.uint64)  # content fingerprint per id (with history)
        self.score = np.zeros(capacity, dtype=np.float64)  # linear decayed count per id (without history)
        self.t0: float | None = None
        # Each run: [scores, seqs, ids, head position], sorted by (score, seq); `heap` holds (score, seq, run key) of
        # every run's head.
        self.runs: dict[int, list] = {}
        self.heap: list[tuple[float, int, int]] = []
        self._run_keys = 0
        self._seq = 0
        self._count = 0
        self._stored = 0  # entries in runs from their heads on, stale ones included (drives compaction)

    def __len__(self) -> int:
        return self._count

    def __contains__(self, i: object) -> bool:
        return isinstance(i, (int, np.integer)) and bool(self.stamp[int(i)] >= 0)

    def __iter__(self) -> Iterator[int]:
        if not self.runs:
            return
        parts = [(r[0][r[3]:], r[1][r[3]:], r[2][r[3]:]) for r in self.runs.values()]
        scores, seqs, ids = (np.concatenate([p[k] for p in parts]) for k in range(3))
        live = self.stamp[ids] == seqs
        order = np.lexsort((seqs[live], scores[live]))
        yield from ids[live][order].tolist()

    def bind(self, ids: np.ndarray | Sequence[int], keys: Sequence[bytes]) -> None:
        if not len(keys):
            return
        joined = b"".join(keys)
        if len(joined) == 16 * len(keys):  # the usual 128-bit page hashes: their first 8 bytes, one numpy view
            fps = np.frombuffer(joined, dtype=np.uint64)[::2]
        else:
            fps = np.fromiter((int.from_bytes(k[:8].ljust(8, b"\0"), "little") for k in keys), np.uint64, len(keys))
        self.fp[np.asarray(ids, dtype=np.int64)] = fps

    def bind_fingerprints(self, ids: np.ndarray | Sequence[int], fps: np.ndarray) -> None:
        self.fp[np.asarray(ids, dtype=np.int64)] = fps

    def _rebase(self, by: float) -> None:
        """Lower every stored score by `by` (the same float64 subtraction everywhere: the order is unchanged, except
        that two scores within an ulp of each other can round to one; entries tied that way may then pop in their old
        order rather than by seq (the one-heap form had the same caveat). Rare: a rebase comes every 64 half-lives
        with the sketch, every 512 without."""
        for run in self.runs.values():
            run[0] -= by
        self.heap = [(k - by, s, r) for k, s, r in self.heap]  # order unchanged: still a heap

    def _priorities(self, idx: np.ndarray) -> np.ndarray:
        now = self.clock()
        if self.sketch is not None:
            prio, rebase = self.sketch.add(self.fp[idx], now)
            if rebase:
                self._rebase(rebase)
            return prio
        if self.t0 is None:
            self.t0 = now
        exp = self.lam * (now - self.t0)
        if exp > 512.0:  # keep 2**exp far from float64's range: rescale, re-key (order unchanged)
            self.score *= 2.0 ** -exp
            self._rebase(exp)
            self.t0, exp = now, 0.0
        self.score[idx] += 2.0 ** exp
        return np.log2(self.score[idx])

    def insert(self, ids: np.ndarray | Sequence[int], retain_s: float = 0.0) -> None:
        """`retain_s` > 0 (a retention hint): this use's priority is raised by retain_s / half_life, i.e. as if the
        page had been used `retain_s` seconds later (log2 units are half-lives of recency). Only the queued priority
        moves: the count the sketch keeps is this one use, so the next un-hinted use of the page drops the boost, and
        a newer page of equal history overtakes it `retain_s` seconds from now. No effect without decay (lfu)."""
        idx = np.asarray(ids, dtype=np.int64)
        k = idx.size
        if not k:
            return
        self._count += k - int((self.stamp[idx] >= 0).sum())  # a re-insert moves an id, it adds none
        prio = self._priorities(idx)
        if retain_s > 0:
            prio = prio + retain_s * self.lam
        seqs = np.arange(self._seq + 1, self._seq + 1 + k, dtype=np.int64)
        self._seq += k
        self.stamp[idx] = seqs
        if k > 1:  # stable: equal scores keep the given order (seqs ascend), the heap's tie-break
            order = np.argsort(prio, kind="stable")
            prio, seqs, idx = prio[order], seqs[order], idx[order]
        key = self._run_keys = self._run_keys + 1
        self.runs[key] = [prio, seqs, idx, 0]
        heapq.heappush(self.heap, (prio.item(0), seqs.item(0), key))
        self._stored += k
        if self._stored > 4 * self._count + 4096:
            self._compact()

    def remove(self, ids: np.ndarray | Sequence[int]) -> None:
        idx = np.asarray(ids, dtype=np.int64)
        if not idx.size:
            return
        self._count -= int((self.stamp[idx] >= 0).sum())
        self.stamp[idx] = -1

    def removed(self, n: int) -> None:
        self._count -= n

    def pop_oldest(self, n: int) -> list[int]:
        if n > self._count:
            raise ValueError(f"asked to evict {n} of {self._count} evictable ids")
        out: list[int] = []
        heap, runs, stamp, pop = self.heap, self.runs, self.stamp, heapq.heappop
        while len(out) < n:
            _score, seq, key = pop(heap)
            run = runs[key]
            scores, seqs, ids, pos = run
            i = ids.item(pos)
            if stamp[i] == seq:  # the head: before every other run's head
                stamp[i] = -1
                out.append(i)
            start = pos = pos + 1
            need = n - len(out)
            if need and pos < ids.size:
                # The rest of this run that still comes before the next run's head, in one slice.
                end = ids.size if not heap else pos + _before(scores[pos:], seqs[pos:], heap[0][0], heap[0][1])
                chunk, live = ids[pos:end], stamp[ids[pos:end]] == seqs[pos:end]
                hits = np.flatnonzero(live)
                if hits.size > need:
                    end = pos + int(hits[need - 1]) + 1
                    hits = hits[:need]
                taken = chunk[hits]
                stamp[taken] = -1
                out.extend(taken.tolist())
                pos = end
            self._stored -= pos - start + 1
            if pos < ids.size:
                run[3] = pos
                heapq.heappush(heap, (scores.item(pos), seqs.item(pos), key))
            else:
                del runs[key]
        if self.sketch is None:
            self.score[out] = 0.0  # the id's next content starts from no use
        self._count -= n
        return out

    def _compact(self) -> None:
        stamp = self.stamp
        heads: list[tuple[float, int, int]] = []
        for key, (scores, seqs, ids, pos) in list(self.runs.items()):
            live = stamp[ids[pos:]] == seqs[pos:]
            if not live.any():
                del self.runs[key]
                continue
            run = [scores[pos:][live], seqs[pos:][live], ids[pos:][live], 0]
            self.runs[key] = run
            heads.append((run[0].item(0), run[1].item(0), key))
        heapq.heapify(heads)
        self.heap = heads
        self._stored = sum(r[2].size for r in self.runs.values())


def _before(scores: np.ndarray, seqs: np.ndarray, score: float, seq: int) -> int:
    """How many leading entries of a run (sorted by (score, seq)) come before (score, seq)."""
    lo = int(scores.searchsorted(score, "left"))
    hi = int(scores.searchsorted(score, "right"))
    return lo + int(seqs[lo:hi].searchsorted(seq)) if hi > lo else lo
