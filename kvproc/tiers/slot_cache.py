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
from functools import partial
from itertools import takewhile
from operator import is_not
from typing import Sequence

_KNOWN = partial(is_not, None)


class SlotCache:
    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        # Two dicts with the same keys, so a lookup run is two C-level map() passes (a resolve's critical path);
        # `_slots`' insertion order is the learning order: the oldest hints are forgotten first.
        self._slots: dict[bytes, int] = {}
        self._gens: dict[bytes, int] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._slots)

    def learn(self, keys: Sequence[bytes], slots: Sequence[int | None], gens: Sequence[int | None]) -> None:
        """Record where the tier holds `keys` (entries with no slot or generation are skipped)."""
        with self._lock:
            ds, dg = self._slots, self._gens
            for k, s, g in zip(keys, slots, gens):
                if s is None or g is None:
                    continue
                ds.pop(k, None)  # re-learned: now the newest
                ds[k] = s
                dg[k] = g
            excess = len(ds) - self.capacity
            if excess > 0:
                for k in [k for k, _ in zip(ds, range(excess))]:
                    del ds[k], dg[k]

    def run(self, keys: Sequence[bytes]) -> tuple[list[int], list[int]]:
        """(slots, generations) of the longest leading run of `keys` this cache knows."""
        with self._lock:
            slots: list[int] = list(takewhile(_KNOWN, map(self._slots.get, keys)))  # type: ignore[arg-type]
            gens = list(map(self._gens.__getitem__, keys[: len(slots)]))
        return slots, gens

    def forget(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for k in keys:
                if self._slots.pop(k, None) is not None:
                    del self._gens[k]
