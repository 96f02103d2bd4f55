"""`SlotCache`: where the store believes its host tier keeps pages, as hints for speculative loads.

hash -> (page slot, slot generation), learned from this store's own saves once their copy has landed, and from
query hits. A hint is never trusted: a load started from it before the tier is asked (the blocking resolve's
speculative load, `kvproc/store_resolve_blocking.py`) keeps only the leading pages whose (slot, generation) the
tier's hit names too. Why that is safe: the tier bumps a slot's generation each time it hands the slot to a save
and never rewrites a live entry, so an unchanged pair means the slot held that page's bytes from the moment the
store learned it until the hit, and the hit's lease holds it from then on; a copy at any time in between read the
right bytes. A pair that changed (evicted, reused) only costs the wasted copy.

Verified loads (no query at all): a tier that publishes its slot table (`Tier.slot_table`, a window of the host
arena the store maps: `kvproc/tiers/slot_table.py`) lets the store check its beliefs itself, seqlock-style, before
the copy is ordered and after it landed; a resolve whose every wanted page verifies skips the query and the lease
(two messages), and the tier is told afterwards, off the critical path, so its LRU sees the use (`Tier.touch`).
That check trusts the belief no more than the hit does.

Bounded (the tier's page slots: more entries than the tier can hold are stale by construction); thread-safe (the
store's loop learns from saves, resolving threads read and learn from hits).
"""

from __future__ import annotations

import threading
from functools import partial
from itertools import takewhile
from operator import is_not
from typing import Sequence

import numpy as np

from kvproc.native import NATIVE
from kvproc.tiers.slot_table import GEN, TAG, verified_run

_KNOWN = partial(is_not, None)


class SlotCache:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        # key -> (slot, generation): one lookup per page on a resolve's critical path (each is likely a cache miss
        # in a dict this size, right after an engine step); insertion order is the learning order, so the oldest
        # hints are forgotten first.
        self._where: dict[bytes, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._where)

    def learn(self, keys: Sequence[bytes], slots: Sequence[int | None], gens: Sequence[int | None]) -> None:
        """Record where the tier holds `keys` (entries with no slot or generation are skipped)."""
        with self._lock:
            d = self._where
            for k, s, g in zip(keys, slots, gens):
                if s is None or g is None:
                    continue
                d.pop(k, None)  # re-learned: now the newest
                d[k] = (s, g)
            excess = len(d) - self.capacity
            if excess > 0:
                for k in [k for k, _ in zip(d, range(excess))]:
                    del d[k]

    def run(self, keys: Sequence[bytes]) -> tuple[list[int], list[int]]:
        """(slots, generations) of the longest leading run of `keys` this cache knows."""
        with self._lock:
            known = list(takewhile(_KNOWN, map(self._where.get, keys)))
        if not known:
            return [], []
        slots, gens = zip(*known)
        return list(slots), list(gens)

    def run_verified(self, keys: list[bytes], table: np.ndarray) -> tuple[list[int], list[int], int]:
        """`run`, checked against the tier's slot table before a copy is ordered from it (`verified_run`): the
        (slots, generations) of the leading keys the table confirms, and how many leading keys this cache knows at
        all (the ones past the confirmed run are stale beliefs). One C pass where `kvproc._native` is built: on a
        resolve's critical path, right after an engine step, the lookups' cache misses are most of its cost."""
        if NATIVE is not None and type(keys) is list:
            with self._lock:
                slots, gens, known = NATIVE.slot_run_verified(self._where, keys, table[GEN], table[TAG])
            return slots, gens, known
        slots, gens = self.run(keys)
        ok = verified_run(table, slots, gens, keys)
        return slots[:ok], gens[:ok], len(slots)

    def forget(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._where.pop(k, None)

