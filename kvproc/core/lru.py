"""An LRU set of block ids with O(1)-per-call inserts and removals of whole runs.

A request releases hundreds of blocks at once and a probe re-acquires hundreds; an OrderedDict costs ~0.5 us per
block for that. Here each insert is one *run* (a numpy array) stamped with a sequence number; a block belongs to the
run whose stamp it carries, so removing blocks is one vectorised stamp reset, and stale run entries are filtered out
(lazily) when eviction reaches them. Eviction pops the oldest runs, oldest blocks first within a run.

A retention hint (`insert(ids, retain_s=R)`, the serving layer's "this conversation comes back within about R s")
makes a run count as used at now + R: it waits in a heap by that deadline and joins the recency order when the
deadline passes (checked before every insert and eviction, so it lands exactly behind every run used before it).
While it waits it is still evictable, after every un-hinted run: a priority, never a pin. With no hint given the
heap stays empty and nothing else changes.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from typing import Callable, Iterator, Sequence

import numpy as np

from kvproc.native import NATIVE


class RunLru:
    wants_keys = False  # the eviction protocol (`kvproc.core.eviction`): LRU keeps no history by content

    def __init__(self, capacity: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock  # only read while a hinted run waits (`retain_s`)
        # Hinted runs by the time they count as used: (deadline, seq, run), the earliest first.
        self.held: list[tuple[float, int, np.ndarray | list[int]]] = []
        self.stamp = np.full(capacity, -1, dtype=np.int64)  # run sequence a block is in; -1: not in the LRU
        self.runs: OrderedDict[int, np.ndarray | list[int]] = OrderedDict()  # a list until eviction reaches it
        self._seq = 0
        self._count = 0
        self._stored = 0  # ids held in runs, stale ones included (drives compaction)

    def __len__(self) -> int:
        return self._count

    def __contains__(self, bid: object) -> bool:
        return isinstance(bid, (int, np.integer)) and bool(self.stamp[int(bid)] >= 0)

    def __iter__(self) -> Iterator[int]:
        """Oldest first (tests and debugging; not a hot path)."""
        if self.held:
            self._release_due(self.clock())
        for seq, run in [*self.runs.items(), *((s, r) for _, s, r in sorted(self.held, key=lambda h: h[:2]))]:
            arr = np.asarray(run, dtype=np.int64)
            yield from arr[self.stamp[arr] == seq].tolist()

    def _release_due(self, now: float) -> None:
        """Hinted runs whose deadline passed join the recency order, in deadline order: as if used then."""
        held = self.held
        while held and held[0][0] <= now:
            _, seq, run = heapq.heappop(held)
            self.runs[seq] = run

    def insert(self, ids: np.ndarray | Sequence[int], retain_s: float = 0.0) -> None:
        """Add blocks as the most recently used run, in the given order (first = evicted first). `retain_s` > 0:
        as used `retain_s` seconds from now (the run waits in `held` until then)."""
        if self.held:
            self._release_due(self.clock())
        if NATIVE is not None and (type(ids) is list or (type(ids) is np.ndarray and ids.dtype == np.int64)):
            # One C pass, and the list or array is kept as the run (an array is made only when eviction reaches a
            # list): a release of a few dozen blocks would otherwise spend most of its time converting and indexing.
            # The pool's releases come as int64 arrays (`paged_release(packed=True)`): 8 bytes a cached block.
            if not len(ids):
                return
            self._seq += 1
            self._count += len(ids) - NATIVE.lru_stamp(self.stamp, ids, self._seq)  # a re-insert moves a block
            if type(ids) is list:
                # Only ints, never in a cycle: out of the GC's scans. An unbounded pool keeps thousands of runs
                # (millions of ids) that every collection would otherwise walk (the trace replay: 0.29 s of GC ->
                # 0.02 s).
                NATIVE.untrack_atomic(ids)
            self._place(ids, retain_s)
            size = len(ids)
        else:
            arr = np.asarray(ids, dtype=np.int64)
            if not arr.size:
                return
            self._count -= int((self.stamp[arr] >= 0).sum())  # a re-insert moves the block, it does not add one
            self._seq += 1
            self.stamp[arr] = self._seq
            self._place(arr, retain_s)
            self._count += arr.size
            size = arr.size
        self._stored += size
        if self._stored > 4 * self._count + 4096:
            self._compact()

    def _place(self, run: np.ndarray | list[int], retain_s: float) -> None:
        if retain_s > 0:
            heapq.heappush(self.held, (self.clock() + retain_s, self._seq, run))
        else:
            self.runs[self._seq] = run

    def remove(self, ids: np.ndarray | Sequence[int]) -> None:
        """Take blocks out (they were acquired). Ids not in the LRU are ignored."""
        if NATIVE is not None and type(ids) is list:
            self._count -= NATIVE.lru_stamp(self.stamp, ids, -1)
            return
        arr = np.asarray(ids, dtype=np.int64)
        present = self.stamp[arr] >= 0
        self._count -= int(present.sum())
        self.stamp[arr] = -1

    def removed(self, n: int) -> None:
        """`n` blocks were taken out by resetting their stamps directly (`kvproc.native._native.paged_acquire`)."""
        self._count -= n

    def pop_oldest(self, n: int) -> list[int]:
        out: list[np.ndarray] = []
        need = n
        if self.held:
            self._release_due(self.clock())
        held = self.held
        while need > 0:
            # Only hinted runs left: the earliest deadline goes first (a hint never pins); what that run keeps stays
            # held by its deadline.
            from_held = not self.runs
            if from_held:
                deadline, seq, listed = held[0]
            else:
                seq, listed = next(iter(self.runs.items()))
            run = np.asarray(listed, dtype=np.int64)
            valid = run[self.stamp[run] == seq]
            take = valid[:need]
            if len(valid) > need:
                if from_held:
                    held[0] = (deadline, seq, valid[need:])  # the same key: still a heap
                else:
                    self.runs[seq] = valid[need:]
                self._stored -= run.size - (valid.size - need)
            else:
                if from_held:
                    heapq.heappop(held)
                else:
                    del self.runs[seq]
                self._stored -= run.size
            self.stamp[take] = -1
            out.append(take)
            need -= take.size
        self._count -= n
        return np.concatenate(out).tolist() if out else []

    def bind(self, ids: np.ndarray | Sequence[int], keys: Sequence[bytes]) -> None:
        """Not called (`wants_keys` is False): the protocol's hook for policies that key history by content."""

    def _compact(self) -> None:
        for seq in list(self.runs):
            run = np.asarray(self.runs[seq], dtype=np.int64)
            valid = run[self.stamp[run] == seq]
            if valid.size:
                self.runs[seq] = valid
            else:
                del self.runs[seq]
        if self.held:
            kept: list[tuple[float, int, np.ndarray | list[int]]] = []
            for deadline, seq, listed in self.held:
                run = np.asarray(listed, dtype=np.int64)
                valid = run[self.stamp[run] == seq]
                if valid.size:
                    kept.append((deadline, seq, valid))
            heapq.heapify(kept)
            self.held = kept
        self._stored = self._count
