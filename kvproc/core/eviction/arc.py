"""Adaptive replacement (ARC, Megiddo & Modha 2003) behind the eviction protocol: measured against lrfu (issue 35).

Two lists of cached ids: T1 (content used once since it was filled) and T2 (used again), each least recently used
first, and two ghost lists of the *content keys* (fingerprints) last evicted from each, B1 and B2. A fill whose key is
in B1 means T1 was too small: the target size `p` of T1 grows; one in B2 shrinks it; either fill goes to T2. A
victim comes from T1 while T1 holds more than `p`, else from T2.

Fitted to the protocol: an id enters a list when a use ends (`insert`), and stays counted in its list while it is
referenced (an ARC cache holds those pages too); only evictable ids (`stamp >= 0`) can be victims, and an entry whose
stamp no longer matches (referenced since, or re-inserted) is skipped and dropped when eviction reaches it. The
first `insert` after `bind` is the content's first use (T1, or T2 on a ghost hit); a later one is a reuse (T2).

Per-id Python work (OrderedDicts): this is a measured candidate, not a hot-path policy (bench/RESULTS.md, "Trace
replay").
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Sequence

import numpy as np

_NONE, _T1, _T2 = 0, 1, 2


class AdaptiveReplacement:
    wants_keys = True  # the ghost lists remember evicted content by key

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.stamp = np.full(capacity, -1, dtype=np.int64)
        self.fp = np.zeros(capacity, dtype=np.uint64)
        self.fresh = np.zeros(capacity, dtype=bool)  # bound to new content, not used yet
        self.where = np.zeros(capacity, dtype=np.int8)  # _T1 / _T2 while cached (referenced or not), else _NONE
        self.lists: tuple[OrderedDict[int, int], OrderedDict[int, int]] = (OrderedDict(), OrderedDict())  # id -> seq
        self.sizes = [0, 0]  # cached ids in T1, T2 (evictable or referenced)
        self.ghosts: tuple[OrderedDict[int, None], OrderedDict[int, None]] = (OrderedDict(), OrderedDict())
        self.p = 0.0  # target size of T1
        self._seq = 0
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __contains__(self, i: object) -> bool:
        return isinstance(i, (int, np.integer)) and bool(self.stamp[int(i)] >= 0)

    def __iter__(self) -> Iterator[int]:
        """Evictable ids, T1's then T2's, each oldest first (the order is `p`-dependent at eviction)."""
        for lst in self.lists:
            yield from (i for i, s in lst.items() if self.stamp[i] == s)

    def bind(self, ids: np.ndarray | Sequence[int], keys: Sequence[bytes]) -> None:
        fps = [int.from_bytes(k[:8].ljust(8, b"\0"), "little") for k in keys]
        self.bind_fingerprints(ids, np.array(fps, dtype=np.uint64))

    def bind_fingerprints(self, ids: np.ndarray | Sequence[int], fps: np.ndarray) -> None:
        idx = np.asarray(ids, dtype=np.int64)
        for i in idx.tolist():  # an id re-bound without an eviction (an owner's displaced duplicate) leaves its list
            self._forget(i)
        self.fp[idx] = fps
        self.fresh[idx] = True

    def _forget(self, i: int) -> None:
        w = int(self.where[i])
        if w != _NONE:
            self.sizes[w - 1] -= 1
            self.lists[w - 1].pop(i, None)
            self.where[i] = _NONE

    def insert(self, ids: np.ndarray | Sequence[int]) -> None:
        for i in np.asarray(ids, dtype=np.int64).tolist():
            if self.stamp[i] < 0:
                self._count += 1
            target = _T2
            if self.fresh[i]:  # the content's first use since its fill
                self.fresh[i] = False
                key = int(self.fp[i])
                b1, b2 = self.ghosts
                if key in b1:  # evicted from T1 too early: T1 should be larger
                    self.p = min(float(self.capacity), self.p + max(1.0, len(b2) / len(b1)))
                    del b1[key]
                elif key in b2:  # evicted from T2 too early: T2 should be larger
                    self.p = max(0.0, self.p - max(1.0, len(b1) / len(b2)))
                    del b2[key]
                else:
                    target = _T1
                self._forget(i)
            else:
                self._forget(i)
            self._seq += 1
            self.stamp[i] = self._seq
            self.lists[target - 1][i] = self._seq
            self.where[i] = target
            self.sizes[target - 1] += 1

    def remove(self, ids: np.ndarray | Sequence[int]) -> None:
        idx = np.asarray(ids, dtype=np.int64)
        if idx.size:
            self._count -= int((self.stamp[idx] >= 0).sum())
            self.stamp[idx] = -1  # still cached, still counted in its list; its entry goes stale

    def removed(self, n: int) -> None:
        self._count -= n

    def pop_oldest(self, n: int) -> list[int]:
        if n > self._count:
            raise ValueError(f"asked to evict {n} of {self._count} evictable ids")
        out: list[int] = []
        while len(out) < n:
            first = 0 if self.sizes[0] > max(self.p, 0.0) or self.sizes[1] == 0 else 1
            i = self._pop_live(first)
            if i is None:
                i = self._pop_live(1 - first)
            assert i is not None  # n <= the evictable count
            out.append(i)
        self._count -= n
        return out

    def _pop_live(self, which: int) -> int | None:
        lst, stamp = self.lists[which], self.stamp
        while lst:
            i, seq = lst.popitem(last=False)
            if stamp[i] != seq:
                continue  # referenced since: it comes back to a list when its use ends
            stamp[i] = -1
            self.where[i] = _NONE
            self.sizes[which] -= 1
            ghosts = self.ghosts[which]
            ghosts[int(self.fp[i])] = None
            # ARC's bounds: T1 + B1 <= c, everything <= 2c.
            while self.ghosts[0] and len(self.ghosts[0]) + self.sizes[0] > self.capacity:
                self.ghosts[0].popitem(last=False)
            while self.ghosts[1] and sum(map(len, self.ghosts)) + sum(self.sizes) > 2 * self.capacity:
                self.ghosts[1].popitem(last=False)
            return i
        return None
