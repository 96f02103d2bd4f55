"""Slots of one bounded group (sliding-window rings, recurrent state, conv state) on one rank.

The group's arenas hold `num_slots` slots. The first `live_slots` are live slots, one per admitted request, rewritten
in place by every step and never shared. The rest are staging slots: sealed copies (seal-by-copy) that checkpoints
refer to. A staging slot moves free -> pending (a copy order is out, not yet fenced) -> sealed (part of a checkpoint,
refcounted by holds, LRU-evictable when unreferenced). Like `PagedBlocks`, this is called under the pool's lock.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


class CopyKind(enum.Enum):
    SEAL = "seal"  # live slot -> staging slot (the sealed artifact)
    RESTORE = "restore"  # staging slot -> live slot (a prefix hit resumes from the checkpoint)
    # paged block -> private paged block, per paged group: copy-on-restore of a shared page a request must append to
    # (the padded boundary page of a P/D hand-off). Slots here are block ids.
    PRIVATIZE = "privatize"


@dataclass(frozen=True)
class CopyOrder:
    """A device->device copy of one bounded slot (every arena of `group`) that the engine must execute and then
    fence with `BlockPool.fence(order, ok)`. For SEAL orders the live slot must not be written by the next step
    until the order is fenced; until then the staging slot is not part of any checkpoint."""

    order_id: int
    kind: CopyKind
    group: str
    src_slot: int
    dst_slot: int
    staging_generation: int
    key: bytes | None  # checkpoint hash a SEAL order registers under; None for RESTORE
    req_id: str = ""
    # The serial of the pool that issued it (`BlockPool.serial`): order ids are per pool, so an order of another rank
    # or store could name one of this pool's open orders by id; the serial tells them apart.
    pool_serial: int = 0


class BoundedSlab:
    def __init__(self, group: str, num_slots: int, live_slots: int) -> None:
        if not 0 < live_slots < num_slots:
            raise ValueError(
                f"bounded group {group!r}: live_slots={live_slots} must be in [1, num_slots={num_slots}) so that at"
                " least one staging slot exists"
            )
        self.group = group
        self.num_slots = num_slots
        self.live_slots = live_slots
        self.live_free: list[int] = list(range(live_slots - 1, -1, -1))
        self.staging_free: list[int] = list(range(num_slots - 1, live_slots - 1, -1))
        self.refcount = np.zeros(num_slots, dtype=np.int32)
        self.generation = np.zeros(num_slots, dtype=np.int64)
        self.key: dict[int, bytes] = {}  # sealed staging slot -> checkpoint hash
        self.pending: set[int] = set()
        self.lru: OrderedDict[int, None] = OrderedDict()  # sealed, unreferenced
        self.evictions = 0

    # -- live slots -----------------------------------------------------------------------------------------------
    def take_live(self) -> int | None:
        return self.live_free.pop() if self.live_free else None

    def give_live(self, slot: int) -> None:
        self.live_free.append(slot)

    # -- staging slots --------------------------------------------------------------------------------------------
    @property
    def staging_available(self) -> int:
        return len(self.staging_free) + len(self.lru)

    def take_staging(self) -> tuple[int, bytes | None] | None:
        """A staging slot with refcount 1 (pending), or None. Returns the evicted slot's old key so the checkpoint
        index can drop it."""
        evicted: bytes | None = None
        if self.staging_free:
            slot = self.staging_free.pop()
        elif self.lru:
            slot, _ = self.lru.popitem(last=False)
            evicted = self.key.pop(slot)
            self.evictions += 1
        else:
            return None
        self.refcount[slot] = 1
        self.generation[slot] += 1
        self.pending.add(slot)
        return slot, evicted

    def seal(self, slot: int, key: bytes) -> None:
        """A pending copy landed: the slot now holds the checkpoint at `key` (still referenced by the order)."""
        self.pending.discard(slot)
        self.key[slot] = key

    def acquire(self, slot: int) -> None:
        if self.refcount[slot] == 0:
            del self.lru[slot]
        self.refcount[slot] += 1

    def release(self, slot: int) -> bool:
        """Drop one reference; returns True if the slot went back to free (it held no sealed checkpoint)."""
        self.refcount[slot] -= 1
        if self.refcount[slot] < 0:
            self.refcount[slot] = 0
            raise RuntimeError(f"bounded group {self.group!r}: refcount underflow on slot {slot}")
        if self.refcount[slot] > 0:
            return False
        self.pending.discard(slot)
        if slot in self.key:
            self.lru[slot] = None
            return False
        self.staging_free.append(slot)
        return True

    def evict_all(self) -> list[bytes]:
        """Free every sealed, unreferenced staging slot; returns the checkpoint keys they held."""
        keys = []
        while self.lru:
            slot, _ = self.lru.popitem(last=False)
            keys.append(self.key.pop(slot))
            self.staging_free.append(slot)
            self.evictions += 1
        return keys

    def drop_key(self, slot: int) -> None:
        """Forget a sealed slot's checkpoint (a duplicate); the slot frees when its last reference goes."""
        self.key.pop(slot, None)
        if self.refcount[slot] == 0 and slot in self.lru:
            del self.lru[slot]
            self.staging_free.append(slot)
