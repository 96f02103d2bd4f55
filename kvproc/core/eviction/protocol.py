"""What an eviction policy is to its owner (the device pool's `PagedBlocks`, the host tier's `HostIndex`).

The owner keeps the reference counts; the policy only orders the *evictable* ids (sealed or committed, unreferenced,
not pinned) and names victims. It never sees a referenced id, so it cannot evict one: an id leaves the policy the
moment it is referenced (`remove`, or the owner's C pass resetting `stamp`) and comes back when its last reference
goes (`insert`). That split is what makes "never evicts a pinned, leased or hand-off page" a property of the owner's
book-keeping, tested once for every policy (tests/core/test_eviction_properties.py).

The `stamp` array is shared with the owners' C passes (`kvproc.native._native.paged_acquire` sets an acquired id's
stamp to -1 and returns how many it took out): `stamp[i] >= 0` iff id i is evictable now. A policy must treat a
reset stamp as a removal and be told the count through `removed`.
"""

from __future__ import annotations

from typing import Iterator, Protocol, Sequence, runtime_checkable

import numpy as np


@runtime_checkable
class EvictionPolicy(Protocol):
    stamp: np.ndarray  # int64 per id: >= 0 iff evictable (the owners' C passes read and reset it)
    # True when the policy wants each id's content key (`bind`): history that outlives an eviction is kept by key.
    wants_keys: bool

    def __len__(self) -> int:
        """Evictable ids."""

    def __contains__(self, i: object) -> bool: ...

    def __iter__(self) -> Iterator[int]:
        """Evictable ids, first victim first (tests and rare paths; not a hot path)."""

    def insert(self, ids: np.ndarray | Sequence[int], retain_s: float = 0.0) -> None:
        """These ids became evictable (one use of each ended), in the given order: among equals, first = evicted
        first. Owners pass a request's ids tail first, so a chain's tail goes before its shared head.
        `retain_s` > 0 is a retention hint from the serving layer (the request's conversation comes back within
        about that long): the ids rank as if this use happened `retain_s` seconds later. A priority, never a pin:
        they stay evictable, and 0 changes nothing."""

    def remove(self, ids: np.ndarray | Sequence[int]) -> None:
        """These ids were referenced: no longer evictable. Ids not in the policy are ignored."""

    def removed(self, n: int) -> None:
        """`n` ids were taken out by a C pass that reset their stamps directly."""

    def pop_oldest(self, n: int) -> list[int]:
        """Evict `n` ids (n <= len): the policy's victims, in eviction order. Their content is gone."""

    def bind(self, ids: np.ndarray | Sequence[int], keys: Sequence[bytes]) -> None:
        """Ids now hold the content named by `keys` (page hashes); only called when `wants_keys`."""
