"""An LRU set of block ids with O(1)-per-call inserts and removals of whole runs.

A request releases hundreds of blocks at once and a probe re-acquires hundreds; an OrderedDict costs ~0.5 us per
block for that. Here each insert is one *run* (a numpy array) stamped with a sequence number; a block belongs to the
run whose stamp it carries, so removing blocks is one vectorised stamp reset, and stale run entries are filtered out
(lazily) when eviction reaches them. Eviction pops the oldest runs, oldest blocks first within a run.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterator, Sequence

import numpy as np

from kvproc.native import NATIVE


class RunLru:
    wants_keys = False  # the eviction protocol (`kvproc.core.eviction`): LRU keeps no history by content

    def __init__(self, capacity: int) -> None:
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
        for seq, run in self.runs.items():
            arr = np.asarray(run, dtype=np.int64)
            yield from arr[self.stamp[arr] == seq].tolist()

    def insert(self, ids: np.ndarray | Sequence[int]) -> None:
        """Add blocks as the most recently used run, in the given order (first = evicted first)."""
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
            self.runs[self._seq] = ids
            size = len(ids)
        else:
            arr = np.asarray(ids, dtype=np.int64)
            if not arr.size:
                return
            self._count -= int((self.stamp[arr] >= 0).sum())  # a re-insert moves the block, it does not add one
            self._seq += 1
            self.stamp[arr] = self._seq
            self.runs[self._seq] = arr
            self._count += arr.size
            size = arr.size
        self._stored += size
        if self._stored > 4 * self._count + 4096:
            self._compact()

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
        while need > 0:
            seq, listed = next(iter(self.runs.items()))
            run = np.asarray(listed, dtype=np.int64)
            valid = run[self.stamp[run] == seq]
            take = valid[:need]
            if len(valid) > need:
                self.runs[seq] = valid[need:]
                self._stored -= run.size - (valid.size - need)
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
        self._stored = self._count
