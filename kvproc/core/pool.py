"""`BlockPool`: one rank's KV memory -- paged blocks, bounded slots, the checkpoint index -- under one lock.

Accounting (reference design section 5):
- `available` = free + evictable paged blocks.
- `entitled` = sum over admitted requests of `lifetime - resident - pending_credit`: blocks admitted requests may
  still draw. Invariant: `available >= entitled` at every instant, so an admitted request's draw never fails.
- Admission (`RequestKv.try_admit`) and opportunistic reservation (`reserve_loaded_blocks`) check against that floor
  under the same lock. A probe never takes an evictable block below the floor either (its hold is truncated and the
  miss reason says POOL_PRESSURE).
- Pinned blocks (in-flight saves) are referenced, hence not available: they are subtracted from admission capacity
  by construction.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np

from kvproc.contract import ArenaLayout, KvSpec
from kvproc.core.bounded import BoundedSlab, CopyKind, CopyOrder
from kvproc.core.checkpoints import CheckpointIndex
from kvproc.core.hashing import BlockHasher
from kvproc.core.holds import (
    HoldState,
    MissReason,
    Pin,
    PinState,
    PrefixHold,
    Reservation,
    ReservationState,
    ReusePolicy,
)
from kvproc.core.ownership import ForeignHandleError, next_pool_serial
from kvproc.core.paged import PagedBlocks, PoolExhaustedError, StaleBlockError
from kvproc.core.request_kv import KvState

_EMPTY_GENS = np.zeros(0, dtype=np.int64)
_PROBE_COUNTER = {r: f"probe_{r.value}" for r in MissReason}  # built once: an enum's .value costs ~1 us a call


@dataclass
class _OrderState:
    order: CopyOrder
    owner: object | None  # the RequestKv state waiting on it (SEAL and RESTORE orders gate that request's steps)


class BlockPool:
    def __init__(
        self,
        spec: KvSpec,
        num_blocks: int,
        *,
        bounded_slots: dict[str, int] | None = None,
        live_slots: int = 1,
        rank: int = 0,
        hasher: BlockHasher | None = None,
        eviction: str = "lru",
    ) -> None:
        self.spec = spec
        self.hasher = hasher or BlockHasher(spec.page_tokens, namespace=spec.model_id)
        self.rank = rank
        self.serial = next_pool_serial()  # this pool's identity for the handles it hands out (core/ownership.py)
        # What errors call it; a store renames its pools after itself, so that two stores' rank 0 read apart.
        self.label = f"pool #{self.serial} (rank {rank})"
        self.page_tokens = spec.page_tokens
        self.lock = threading.Lock()
        self.paged = PagedBlocks(num_blocks, eviction)  # eviction: a `kvproc.core.eviction` policy name
        bounded_slots = bounded_slots or {}
        self.slabs: dict[str, BoundedSlab] = {}
        for g in spec.bounded_groups:
            if g.name not in bounded_slots:
                raise ValueError(f"bounded group {g.name!r} needs a slot count in bounded_slots")
            self.slabs[g.name] = BoundedSlab(g.name, bounded_slots[g.name], live_slots)
        self.checkpoints = CheckpointIndex(spec.restorable_bounded_groups)
        self.entitled = 0
        self.admitted_states: dict[int, object] = {}  # id(state) -> admitted RequestKv state (theirs to add and drop)
        self._pinned = 0
        self._orders: dict[int, _OrderState] = {}
        self._order_ids = itertools.count(1)
        self._deferred: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._capacity_listeners: list[Callable[[], None]] = []
        self.counters: Counter[str] = Counter()

    @classmethod
    def from_layout(
        cls, layout: ArenaLayout, *, live_slots: int, rank: int = 0, hasher: BlockHasher | None = None,
        eviction: str = "lru",
    ) -> "BlockPool":
        return cls(
            layout.spec,
            max(layout.num_paged_blocks, 1),
            bounded_slots=layout.bounded_slots,
            live_slots=live_slots,
            rank=rank,
            hasher=hasher,
            eviction=eviction,
        )

    # -- capacity -------------------------------------------------------------------------------------------------
    @property
    def available(self) -> int:
        return self.paged.available

    def pinned_blocks(self) -> int:
        return self._pinned

    def frees_blocks_by_itself(self) -> bool:
        """Whether something in this pool will release blocks without any other request being resolved first: an
        admitted request (it runs to its end) or a save's pin (its copy lands). Holds and reservations do not count:
        a resolve or the engine releases those, and a resolve waiting for capacity must not wait for them."""
        return bool(self.admitted_states) or self._pinned > 0

    def on_capacity_freed(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` (outside the lock, on the releasing thread) whenever blocks or slots are released.
        Returns an unsubscribe function. This is the pool-side waiter resolve uses instead of a sleep loop."""
        with self.lock:
            self._capacity_listeners.append(callback)

        def unsubscribe() -> None:
            with self.lock:
                if callback in self._capacity_listeners:
                    self._capacity_listeners.remove(callback)

        return unsubscribe

    # The seam to `RequestKv` (one unit with the pool, in its own file): `notify_capacity`, `defer_release`,
    # `take_staging_locked`, `new_order` and `admitted_states` are what a request's KV may touch of the pool.
    def notify_capacity(self) -> None:
        """Wake capacity waiters (after blocks or staging slots went back)."""
        for cb in list(self._capacity_listeners):
            cb()

    # -- deferred release (garbage-collected handles) -------------------------------------------------------------
    def defer_release(self, state: object) -> None:
        """A handle was garbage-collected: release its state at the next locked operation (never in a finalizer)."""
        self._deferred.put(state)

    def drain_deferred(self) -> int:
        """Release the references of garbage-collected handles. Called at the start of every locked operation."""
        n = 0
        while not self._deferred.empty():  # checked first: an empty get_nowait() raises, on every locked call
            try:
                state = self._deferred.get_nowait()
            except queue.Empty:
                break
            n += 1
            self._release_state(state)
        return n

    def _release_state(self, state: object) -> None:
        """Release a handle's references (hold, reservation, pin or request state) and wake capacity waiters."""
        with self.lock:
            self._release_any_locked(state)
        self.notify_capacity()

    def _release_any_locked(self, state: object) -> None:
        if isinstance(state, HoldState):
            self._release_hold_locked(state)
        elif isinstance(state, ReservationState):
            self._release_reservation_locked(state)
        elif isinstance(state, PinState):
            self._release_pin_locked(state)
        elif isinstance(state, KvState):
            state.release_locked(self)
            self.counters["requests_released_by_gc"] += 1

    # -- probe ----------------------------------------------------------------------------------------------------
    def probe(
        self,
        hashes: Sequence[bytes],
        num_tokens: int,
        policy: ReusePolicy = ReusePolicy.CAPPED,
    ) -> PrefixHold:
        """Match the longest restorable prefix and hold it (references only, no allocation)."""
        self.drain_deferred()
        P = self.page_tokens
        if not self.spec.prefix_caching:
            with self.lock:
                self.counters["miss_prefix_caching_off"] += 1
            return self._hold(HoldState([], _EMPTY_GENS, [], {}), MissReason.PREFIX_CACHING_OFF, 0)
        full = min(len(hashes), num_tokens // P)
        cap = full if policy is ReusePolicy.FULL_PAGES else max(0, (num_tokens - 1) // P)
        with self.lock:
            ids = self.paged.match(hashes[:full])
            if not ids:  # nothing on the device (a host hit's usual case): no checkpoint, nothing to hold
                self.counters[_PROBE_COUNTER[MissReason.NO_ENTRY]] += 1
                return self._hold(HoldState([], _EMPTY_GENS, [], {}), MissReason.NO_ENTRY, 0)
            matched = len(ids)
            usable = min(matched, cap)
            depth, artifacts, incomplete = self.checkpoints.deepest_complete(hashes, usable)
            floor = self._truncate_to_floor(ids, depth)
            pressure = floor < depth
            if pressure:
                # Truncation moved below the checkpoint: find the deepest complete one within what may be held.
                depth, artifacts, _ = self.checkpoints.deepest_complete(hashes, floor)
            ids = ids[:depth]
            self.paged.acquire(ids)
            held_artifacts = self._acquire_artifacts_locked(artifacts)
            gens = self.paged.generations(ids)
            if depth:
                reason = MissReason.HIT
            elif matched == 0:
                reason = MissReason.NO_ENTRY
            elif usable == 0:
                reason = MissReason.BELOW_REUSE_CAP
            elif pressure:
                reason = MissReason.POOL_PRESSURE
            else:
                reason = MissReason.ENTRY_INCOMPLETE
            self.counters[_PROBE_COUNTER[reason]] += 1
            self.counters["probe_hit_blocks"] += depth
        return self._hold(HoldState(ids, gens, list(hashes[:depth]), held_artifacts), reason, matched)

    def _acquire_artifacts_locked(self, artifacts: dict[str, int]) -> dict[str, tuple[int, int]]:
        """Reference a checkpoint's staging slots for a hold: group -> (slot, generation)."""
        held: dict[str, tuple[int, int]] = {}
        for group, slot in artifacts.items():
            slab = self.slabs[group]
            slab.acquire(slot)
            held[group] = (slot, int(slab.generation[slot]))
        return held

    def _truncate_to_floor(self, ids: list[int], depth: int) -> int:
        """The deepest prefix of `ids[:depth]` whose evictable blocks can be held without eating the entitled floor."""
        if depth == 0:
            return 0
        budget = self.paged.available - self.entitled
        if depth <= budget:  # at most `depth` of them are evictable: all fit (no array work: the usual case)
            return depth
        idx = np.asarray(ids[:depth], dtype=np.int64)
        inactive_cum = np.cumsum(self.paged.refcount[idx] == 0)
        if inactive_cum[-1] <= budget:
            return depth
        self.counters["probe_truncated_by_pressure"] += 1
        return int(np.searchsorted(inactive_cum, budget, side="right"))

    # -- ownership ------------------------------------------------------------------------------------------------
    def check_handle(self, handle: PrefixHold | Reservation | Pin, what: str, used_with: str | None = None) -> None:
        """Refuse a hold, reservation or pin this pool did not hand out (`ForeignHandleError`, nothing consumed)."""
        if handle.pool is not self:
            raise ForeignHandleError(what, handle.pool.label, used_with or self.label)

    def check_order(self, order: CopyOrder, used_with: str | None = None) -> None:
        """Refuse a copy order another pool issued: its id may name one of this pool's own open orders."""
        if order.pool_serial != self.serial:
            raise ForeignHandleError(f"copy order {order.order_id} ({order.kind.value}, request {order.req_id!r})",
                                     f"pool #{order.pool_serial}", used_with or self.label)

    def trim_hold(self, hold: PrefixHold, pages: int) -> int:
        """Shorten a hold to at most `pages` pages, to the deepest complete checkpoint at or below it (a bounded
        group's state must exist where the hold ends), giving back the rest. Returns the pages it keeps."""
        self.check_handle(hold, "prefix hold")
        state = hold._live()
        if pages < 0:
            raise ValueError(f"cannot trim a hold to {pages} pages")
        if pages >= len(state.ids):
            return len(state.ids)
        with self.lock:
            depth, artifacts, _ = self.checkpoints.deepest_complete(state.hashes, pages) if pages else (0, {}, False)
            held = self._acquire_artifacts_locked(artifacts)  # the new end's checkpoint, before the old one goes
            for group, (slot, _gen) in state.artifacts.items():
                self.slabs[group].release(slot)
            self.counters["hold_trimmed_pages"] += len(state.ids) - depth
            self.paged.release(state.ids[depth:])
            state.ids, state.gens, state.hashes = state.ids[:depth], state.gens[:depth], state.hashes[:depth]
            state.artifacts = held
        self.notify_capacity()
        return depth

    def _hold(self, state: HoldState, reason: MissReason, matched: int) -> PrefixHold:
        return PrefixHold(self, state, reason=reason, matched_pages=matched, page_tokens=self.page_tokens)

    def check_hold(self, hold: PrefixHold) -> None:
        """Raise `StaleBlockError` if any block of the hold was reused (cannot happen while the hold is alive)."""
        self.check_handle(hold, "prefix hold")
        with self.lock:
            self.paged.check(hold.block_ids, hold.generations)

    def check_blocks(self, ids: Sequence[int], gens: Sequence[int] | np.ndarray) -> None:
        with self.lock:
            self.paged.check(ids, np.asarray(gens))

    # -- opportunistic reservation for loads ----------------------------------------------------------------------
    def reserve_loaded_blocks(self, n: int, staging_groups: Iterable[str] = ()) -> Reservation | None:
        """Reserve `n` destination blocks (plus one staging slot per named bounded group) for a load, only above the
        admission floor (`available >= n + entitled`). None if the pool cannot: the caller waits or degrades."""
        self.drain_deferred()
        groups = list(staging_groups)
        with self.lock:
            if self.paged.available < n + self.entitled or any(
                self.slabs[g].staging_available < 1 for g in groups
            ):
                self.counters["reserve_declined"] += 1
                return None
            ids, gens = self.paged.allocate_with_generations(n)
            staging: dict[str, tuple[int, int]] = {}
            for g in groups:
                got = self.take_staging_locked(g)
                assert got is not None  # checked above under the same lock
                staging[g] = got
            self.counters["reserve_ok"] += 1
        return Reservation(self, ReservationState(ids, gens, staging))

    def evict_cached(self) -> int:
        """Evict everything the device pool caches and nobody holds: sealed unreferenced blocks and checkpoints (a
        later probe misses them; blocks and checkpoints a request, hold, reservation or pin references stay). For
        tests of a restore from the host tier, and for an operator who wants the device cache cold. Returns the
        blocks + staging slots freed."""
        with self.lock:
            n = self.paged.evict_all()
            for group, slab in self.slabs.items():
                for key in slab.evict_all():
                    self.checkpoints.drop(key, group)
                    n += 1
            self.counters["evicted_on_purpose"] += n
        self.notify_capacity()
        return n

    def take_staging_locked(self, group: str) -> tuple[int, int] | None:
        slab = self.slabs[group]
        got = slab.take_staging()
        if got is None:
            return None
        slot, evicted_key = got
        if evicted_key is not None:
            self.checkpoints.drop(evicted_key, group)
        return slot, int(slab.generation[slot])

    def commit_loaded_blocks(self, reservation: Reservation, hold: PrefixHold, hashes: Sequence[bytes]) -> None:
        """Restore = register the loaded blocks under the probe's next hashes, then extend the hold with them.

        `hashes` are the hashes of the pages the reservation's blocks now hold, continuing the hold's chain. With
        restorable bounded groups the reservation must carry their staging slots: a deeper paged prefix without the
        bounded state at its end would restore pages that no checkpoint vouches for.
        """
        self.check_handle(hold, "prefix hold")
        self.check_handle(reservation, "reservation")
        hs = hold._live()  # checked first: a consumed hold must not strand the reservation
        res = reservation._take()
        missing = [g for g in self.checkpoints.required if hashes and g not in res.staging]
        if len(hashes) != len(res.ids) or missing or not hashes:
            self._release_state(res)
            if not hashes:
                return  # nothing was loaded: the reservation (and any staging slot) simply goes back
            raise ValueError(
                f"commit of {len(res.ids)} loaded blocks got {len(hashes)} hashes"
                + (f" and no staging slot for bounded group(s) {missing}" if missing else "")
            )
        with self.lock:
            self.paged.check(res.ids, res.gens)
            # KV events' token ids: the restored pages' are the prompt's from the hold's end on. The prompt itself,
            # neither sliced nor copied here (a resolve's path): the engine does not change a prompt it resolved
            # (`KvStore.resolve_prefix`), and the publisher's thread slices it as it builds the event.
            if self.paged.listener is None:
                self.paged.register(res.ids, hashes)
            else:  # the restored pages follow the hold's: their parent is its last page
                self.paged.register(res.ids, hashes, hold.prompt_tokens, len(hs.ids),
                                    hs.hashes[-1] if hs.hashes else None)
            final = res.ids
            hs.ids.extend(final)
            # just checked: the reservation's generations are current (and its own array: the reservation is spent)
            hs.gens = np.concatenate((hs.gens, res.gens)) if len(hs.gens) else res.gens
            hs.hashes.extend(hashes)
            if res.staging and hashes:
                key = hashes[-1]
                for group, (slot, _gen) in res.staging.items():
                    slab = self.slabs[group]
                    slab.seal(slot, key)
                    displaced = self.checkpoints.replace(key, group, slot)
                    if displaced is not None and displaced != slot:
                        # Newest wins, as for pages: the older identical copy ages out once unreferenced.
                        slab.drop_key(displaced)
                    old = hs.artifacts.get(group)
                    if old is not None:
                        slab.release(old[0])
                    hs.artifacts[group] = (slot, int(slab.generation[slot]))
            self.counters["committed_loaded_blocks"] += len(final)

    def _release_reservation_locked(self, state: ReservationState) -> None:
        if state.released:
            return
        state.released = True
        self.paged.release(state.ids)
        for group, (slot, _gen) in state.staging.items():
            self.slabs[group].release(slot)

    # -- holds ----------------------------------------------------------------------------------------------------
    def _release_hold_locked(self, state: HoldState) -> None:
        if state.released:
            return
        state.released = True
        self.paged.release(state.ids)
        for group, (slot, _gen) in state.artifacts.items():
            self.slabs[group].release(slot)

    # -- pins (in-flight saves) -----------------------------------------------------------------------------------
    def pin(self, ids: Sequence[int], gens: Sequence[int] | np.ndarray | None = None,
            staging: dict[str, int] | None = None) -> Pin:
        """Pin blocks (and staging slots) for a save: referenced, so neither evicted nor reused until unpinned."""
        self.drain_deferred()
        ids = list(ids)
        with self.lock:
            if gens is not None:
                self.paged.check(ids, np.asarray(gens))
            if ids:
                cold = int((self.paged.refcount[np.asarray(ids, dtype=np.int64)] == 0).sum())
                if cold and self.paged.available - cold < self.entitled:
                    # Pinning evictable blocks would eat admitted requests' entitlement: refuse (saves pin blocks
                    # their request still holds, which costs nothing).
                    raise PoolExhaustedError(f"pinning {cold} evictable blocks would break the entitled floor")
            self.paged.acquire(ids)
            for group, slot in (staging or {}).items():
                self.slabs[group].acquire(slot)
            self._pinned += len(ids)
        return Pin(self, PinState(ids, dict(staging or {})))

    def _release_pin_locked(self, state: PinState) -> None:
        if state.released:
            return
        state.released = True
        self.paged.release(state.ids)
        for group, slot in state.staging.items():
            self.slabs[group].release(slot)
        self._pinned -= len(state.ids)

    # -- bounded copy orders --------------------------------------------------------------------------------------
    def new_order(self, kind: CopyKind, group: str, src: int, dst: int, gen: int, key: bytes | None,
                   owner: object | None, req_id: str) -> CopyOrder:
        order = CopyOrder(next(self._order_ids), kind, group, src, dst, gen, key, req_id, self.serial)
        self._orders[order.order_id] = _OrderState(order, owner)
        return order

    def fence(self, order: CopyOrder, ok: bool = True) -> None:
        """The engine executed `order` (and its step synchronized): make a SEAL copy part of its checkpoint, or
        finish a RESTORE. `ok=False` reports a failed copy: the staging slot is discarded."""
        self.check_order(order)
        with self.lock:
            st = self._orders.pop(order.order_id, None)
            if st is None:
                raise KeyError(f"unknown or already fenced copy order {order.order_id}")
            if order.kind is CopyKind.PRIVATIZE:
                # The source block is held by the order's owner until its last group's copy is fenced.
                self.counters["privatize_copies_fenced" if ok else "privatize_copies_failed"] += 1
                if st.owner is not None:
                    st.owner.order_settled(self, order, ok)  # type: ignore[attr-defined]
                return
            slab = self.slabs[order.group]
            if slab.generation[order.dst_slot if order.kind is CopyKind.SEAL else order.src_slot] != (
                order.staging_generation
            ):
                raise StaleBlockError(f"copy order {order.order_id}: staging slot reused before its fence")
            if order.kind is CopyKind.SEAL:
                if ok and order.key is not None:
                    slab.seal(order.dst_slot, order.key)
                    if not self.checkpoints.add(order.key, order.group, order.dst_slot):
                        slab.drop_key(order.dst_slot)
                    self.counters["seal_copies_fenced"] += 1
                else:
                    self.counters["seal_copies_failed"] += 1
                slab.release(order.dst_slot)
            else:
                slab.release(order.src_slot)
                self.counters["restore_copies_fenced" if ok else "restore_copies_failed"] += 1
            if st.owner is not None:
                st.owner.order_settled(self, order, ok)  # type: ignore[attr-defined]
        self.notify_capacity()

    # -- observability --------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        self.drain_deferred()
        with self.lock:
            out = {
                "num_blocks": self.paged.num_blocks,
                "free_blocks": len(self.paged.free),
                "inactive_blocks": len(self.paged.inactive),
                "active_blocks": self.paged.num_blocks - self.paged.available,
                "available_blocks": self.paged.available,
                "entitled_blocks": self.entitled,
                "pinned_blocks": self._pinned,
                "indexed_pages": len(self.paged.index),
                "evictions": self.paged.evictions,
                "checkpoints": len(self.checkpoints.entries),
                "admitted_requests": len(self.admitted_states),
                "open_copy_orders": len(self._orders),
            }
            for name, slab in self.slabs.items():
                out[f"{name}_live_free"] = len(slab.live_free)
                out[f"{name}_staging_available"] = slab.staging_available
            out.update(self.counters)
        return out

    def recompute_entitled(self) -> int:
        """Recompute `entitled` from the admitted requests (tests check it equals the running total)."""
        with self.lock:
            return sum(s.contribution for s in self.admitted_states.values())  # type: ignore[attr-defined]
