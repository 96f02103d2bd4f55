"""Frequency + recency eviction (LRFU): evict the id whose exponentially decayed use count is lowest.

Score of a page = sum over its uses of 2**(-(now - t_use) / half_life). half_life -> infinity is LFU; a short
half-life is LRU. Ties (equal scores) go in insertion order, so a request's tail (inserted first) goes before its
head. With `history` the score is kept by content key in a count-min sketch (`sketch.py`) and survives the page's
eviction (a conversation whose prefix was evicted and recomputed keeps its count); without it a score starts again
at one use when an id is filled.

On a prefix chain the score is monotone: a page is used whenever any page below it is, so a parent's score is at
least its child's and a leaf goes first (up to sketch over-estimates), which is what keeps a cached prefix
contiguous (a hit needs every page before it).

Cost: a heap of (score, seq, id) with lazy deletion (an entry is live iff `stamp[id] == seq`): insert and evict are
O(log n) per id; stale entries are dropped when reached and the heap is rebuilt when they outnumber live ones 4:1.
"""

from __future__ import annotations

import heapq
import math
import time
from itertools import repeat
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
        self.heap: list[tuple[float, int, int]] = []
        self._seq = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __contains__(self, i: object) -> bool:
        return isinstance(i, (int, np.integer)) and bool(self.stamp[int(i)] >= 0)

    def __iter__(self) -> Iterator[int]:
        stamp = self.stamp
        for _key, seq, i in sorted(self.heap):
            if stamp[i] == seq:
                yield i

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

    def _priorities(self, idx: np.ndarray) -> np.ndarray:
        now = self.clock()
        if self.sketch is not None:
            prio, rebase = self.sketch.add(self.fp[idx], now)
            if rebase:
                self.heap = [(k - rebase, s, i) for k, s, i in self.heap]  # order unchanged: still a heap
            return prio
        if self.t0 is None:
            self.t0 = now
        exp = self.lam * (now - self.t0)
        if exp > 512.0:  # keep 2**exp far from float64's range: rescale, re-key (order unchanged)
            self.score *= 2.0 ** -exp
            self.heap = [(k - exp, s, i) for k, s, i in self.heap]
            self.t0, exp = now, 0.0
        self.score[idx] += 2.0 ** exp
        return np.log2(self.score[idx])

    def insert(self, ids: np.ndarray | Sequence[int]) -> None:
        idx = np.asarray(ids, dtype=np.int64)
        if not idx.size:
            return
        self._count += idx.size - int((self.stamp[idx] >= 0).sum())  # a re-insert moves an id, it adds none
        prio = self._priorities(idx)
        seqs = np.arange(self._seq + 1, self._seq + 1 + idx.size, dtype=np.int64)
        self._seq += idx.size
        self.stamp[idx] = seqs
        # One C-level pass of heappush over the batch (map), no Python frame per id.
        list(map(heapq.heappush, repeat(self.heap), zip(prio.tolist(), seqs.tolist(), idx.tolist())))
        if len(self.heap) > 4 * self._count + 4096:
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
        heap, stamp, pop = self.heap, self.stamp, heapq.heappop
        while len(out) < n:
            _key, seq, i = pop(heap)
            if stamp[i] == seq:
                stamp[i] = -1
                out.append(i)
        if self.sketch is None:
            self.score[out] = 0.0  # the id's next content starts from no use
        self._count -= n
        return out

    def _compact(self) -> None:
        stamp = self.stamp
        self.heap = [e for e in self.heap if stamp[e[2]] == e[1]]
        heapq.heapify(self.heap)
