"""`SlotCache`: where the store believes its host tier keeps pages, as hints for speculative loads.

hash -> (page slot, slot generation), learned from this store's own saves once their copy has landed, and from
query hits. A hint is never trusted: a load started from it before the tier is asked (the blocking resolve's
speculative load, `kvproc/store_resolve_blocking.py`) keeps only the leading pages whose (slot, generation) the
tier's hit names too. Why that is safe: the tier bumps a slot's generation each time it hands the slot to a save
and never rewrites a live entry, so an unchanged pair means the slot held that page's bytes from the moment the
store learned it until the hit, and the hit's lease holds it from then on; a copy at any time in between read the
right bytes. A pair that changed (evicted, reused) only costs the wasted copy.

Bounded (the tier's page slots: more entries than the tier can hold are stale by construction); thread-safe (the
store's loop learns from saves, resolving threads read and learn from hits).
"""

from __future__ import annotations

import threading
from typing import Sequence


class SlotCache:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._slots: dict[bytes, tuple[int, int]] = {}  # insertion order = learning order: oldest forgotten first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._slots)

    def learn(self, keys: Sequence[bytes], slots: Sequence[int | None], gens: Sequence[int | None]) -> None:
        """Record where the tier holds `keys` (entries with no slot or generation are skipped)."""
        with self._lock:
            d = self._slots
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
        slots: list[int] = []
        gens: list[int] = []
        get = self._slots.get
        with self._lock:
            for k in keys:
                v = get(k)
                if v is None:
                    break
                slots.append(v[0])
                gens.append(v[1])
        return slots, gens

    def forget(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                self._slots.pop(k, None)
