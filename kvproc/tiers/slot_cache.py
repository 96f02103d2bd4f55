"""`SlotCache`: where the store believes its host tier keeps pages, as hints for speculative loads.

hash -> (page slot, slot generation), learned from this store's own saves once their copy has landed, and from
query hits. A hint is never trusted: a load started from it before the tier is asked (the blocking resolve's
speculative load, `kvproc/store/resolve_blocking.py`) keeps only the leading pages whose (slot, generation) the
tier's hit names too. Why that is safe: the tier bumps a slot's generation each time it hands the slot to a save
and never rewrites a live entry, so an unchanged pair means the slot held that page's bytes from the moment the
store learned it until the hit, and the hit's lease holds it from then on; a copy at any time in between read the
right bytes. A pair that changed (evicted, reused) only costs the wasted copy.

Verified loads (no query at all): a tier that publishes its slot table (`Tier.slot_table`, a window of the host
arena the store maps: `kvproc/tiers/slot_table.py`) lets the store check its beliefs itself, seqlock-style, before
the copy is ordered and after it landed; a resolve whose every wanted page verifies skips the query and the lease
(two messages), and the tier is told afterwards, off the critical path, so its LRU sees the use (`Tier.touch`).
That check trusts the belief no more than the hit does.

Bounded (the tier's page slots: more entries than the tier can hold are stale by construction), the oldest learned
forgotten first; thread-safe (the store's loop learns from saves, resolving threads read and learn from hits).

Two forms, one behaviour (a hypothesis test runs them side by side): `kvproc.native._native.SlotMap` where the compiled
helpers are built -- an open-addressing table of 32-byte inline entries whose lookups of a resolve's pages prefetch
every bucket and then every slot-table row before comparing any (`kvproc/native/_slotmap.c`: on a resolve's critical path,
right after an engine step, the dict form's dependent cache misses were most of its cost) -- else a dict.
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


KEY_BYTES = 16  # a page hash (`kvproc.core.hashing.BlockHash`)


class SlotCache:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._map = NATIVE.SlotMap(capacity) if NATIVE is not None else None
        # The pure-Python form: key -> (slot, generation); insertion order is the learning order, so the oldest
        # hints are forgotten first.
        self._where: dict[bytes, tuple[int, int]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._map) if self._map is not None else len(self._where)

    def learn(self, keys: Sequence[bytes], slots: Sequence[int | None], gens: Sequence[int | None]) -> None:
        """Record where the tier holds `keys` (entries with no slot or generation are skipped). Keys are 16-byte page
        hashes and slots non-negative: anything else is refused before anything changes."""
        if self._map is not None:
            with self._lock:
                self._map.learn(keys, slots, gens)
            return
        triples = list(zip(keys, slots, gens))
        pairs = [(k, s, g) for k, s, g in triples if s is not None and g is not None]
        for k, _, _ in triples:
            _check_key(k)
        for _, s, _ in pairs:
            if s < 0:
                raise ValueError(f"slot cache: slot {s} is negative")
        with self._lock:
            d = self._where
            for k, s, g in pairs:
                d.pop(k, None)  # re-learned: now the newest
                d[k] = (int(s), int(g))
            excess = len(d) - self.capacity
            if excess > 0:
                for k in [k for k, _ in zip(d, range(excess))]:
                    del d[k]

    def run(self, keys: Sequence[bytes]) -> tuple[list[int], list[int]]:
        """(slots, generations) of the longest leading run of `keys` this cache knows."""
        if self._map is not None:
            with self._lock:
                slots, gens = self._map.run(keys)
            return slots, gens
        with self._lock:
            known = list(takewhile(_KNOWN, map(self._where.get, keys)))
        if not known:
            return [], []
        s, g = zip(*known)
        return list(s), list(g)

    def run_verified(self, keys: list[bytes], table: np.ndarray) -> tuple[list[int], list[int], int]:
        """`run`, checked against the tier's slot table before a copy is ordered from it (`verified_run`): the
        (slots, generations) of the leading keys the table confirms, and how many leading keys this cache knows at
        all (the ones past the confirmed run are stale beliefs). One C pass where `kvproc.native._native` is built."""
        if self._map is not None:
            with self._lock:
                slots, gens, known = self._map.run_verified(keys, table[GEN], table[TAG])
            return slots, gens, known
        slots, gens = self.run(keys)
        ok = verified_run(table, slots, gens, keys)
        return slots[:ok], gens[:ok], len(slots)

    def clear(self) -> None:
        """Forget every hint (the tier was replaced: its slots say nothing about the new one's)."""
        with self._lock:
            if self._map is not None and NATIVE is not None:
                self._map = NATIVE.SlotMap(self.capacity)
            self._where.clear()

    def forget(self, keys: Sequence[bytes]) -> None:
        if self._map is not None:
            with self._lock:
                self._map.forget(keys)
            return
        for k in keys:
            _check_key(k)
        with self._lock:
            for k in keys:
                self._where.pop(k, None)


def _check_key(k: object) -> None:
    if not isinstance(k, bytes):
        raise TypeError(f"slot cache keys must be bytes, got {type(k).__name__}")
    if len(k) != KEY_BYTES:
        raise ValueError(f"slot cache keys must be {KEY_BYTES} bytes, got {len(k)}")
