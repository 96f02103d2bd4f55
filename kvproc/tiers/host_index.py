"""The host tier's index: which checkpoint pages it holds, in which slots, and who may rely on them.

Pure book-keeping (no I/O, no threads): the host-tier process calls it from one thread; the trace-replay benchmark
calls it in-process. Units:
- a **page slot** holds one page of every paged group (one checkpoint page, keyed by its chained hash);
- a **bounded slot** (per bounded group) holds that group's sealed copy at a checkpoint page.

Lifecycles:
- Saves are two-phase: `reserve_save` hands out slots for what is not already present (dedup), the copy worker
  writes, then `commit_save` makes the entries visible (all at once: a reader never sees a partial entry) or
  `abort_save` frees the slots. A pending save makes `query` answer Loading for the page it will fill, and its
  commit/abort is reported through `on_settled` so the tier can notify waiters (no poll-by-requery).
- A `query` Hit holds a **lease** on its entries until released (the load consumed it); a TTL reclaims forgotten
  leases, counted. Entries with no lease, no pending load and no hand-off pin are LRU-evictable.
- `SaveClass.CACHEABLE` saves are shed when no room can be made (counted). `SaveClass.HANDOFF` entries are pinned for
  their producer request until the consumer's load releases them (`consume_handoff`) or the producer revokes them;
  a TTL reclaims forgotten hand-offs as a counted backstop.

Storage: an entry *is* its page slot. `entries` maps a key to its slot; per-slot numpy arrays hold the lease
references and whether the slot may sit in the LRU; the LRU is a `RunLru` of slots, like the device pool's. So a
query's or a release's per-page work is the pool's book-keeping (`kvproc.native._native.paged_acquire` / `paged_release`:
one C pass; numpy where it is not built), not a Python object and an OrderedDict move per page (a 64-page query +
release cost ~44 us of the tier's Python that way).
"""

from __future__ import annotations

import enum
import itertools
import secrets
import time
from collections import Counter
from dataclasses import dataclass
from itertools import takewhile
from typing import Any, Callable, Sequence

import numpy as np

from kvproc.core.eviction import HOST_DEFAULT, make_policy
from kvproc.native import NATIVE
from kvproc.tiers.kv_events import BlockRemoved, BlockStored, KvEvent, page_token_ids
from kvproc.tiers.save_fence import BUSY, NO_FENCE, REVOKED, FenceTable
from kvproc.tiers.slot_table import FENCE, GEN, ROWS


class SaveClass(enum.Enum):
    CACHEABLE = "cacheable"  # fire-and-forget; may be shed under pressure
    HANDOFF = "handoff"  # must be delivered; leased until consumed or revoked


@dataclass(frozen=True)
class Miss:
    pass


@dataclass(frozen=True)
class Loading:
    ready_pages: int  # committed pages before the pending one
    save_id: int  # the pending save whose settlement the caller should wait for


@dataclass(frozen=True)
class Hit:
    pages: int
    lease_id: int
    page_slots: tuple[int, ...]
    bounded_slots: dict[str, int]  # artifacts of the checkpoint at `pages`
    page_gens: tuple[int, ...] = ()  # each page slot's generation (a copy out of them checks it after: `TierSlots`)
    epoch: int = 0  # the store's attachment of the tier that answered (`RemoteTier.epoch`): its loads carry it


QueryResult = Miss | Loading | Hit


@dataclass
class SaveTicket:
    save_id: int
    req_id: str
    save_class: SaveClass
    keys: tuple[bytes, ...]
    page_slots: tuple[int | None, ...]  # None: already present (dedup), nothing to copy
    bounded_slots: dict[str, int | None]  # artifacts at keys[-1]; None: already present
    expires: float
    # The save's fence word and token (`save_fence.py`): the copy worker claims it before writing the slots.
    fence: int = NO_FENCE
    fence_token: int = 0
    # The pages' token ids (`ReserveSave.events`), kept for the BlockStored events of its commit; None: not known
    # (or no events). Never on the wire back.
    token_ids: Any = None
    # The prompt's page before keys[0] (`SaveEvents.parent_key`): the parent of the commit's first BlockStored when
    # its run starts at keys[0]; None: the save starts at the prompt's first page, or not known (or no events).
    parent_key: bytes | None = None
    # A retention hint (seconds, already bounded by `HostIndex.max_retain_s`; 0: none): at commit, the save's pages
    # enter the eviction policy ranked as if used that much later (`EvictionPolicy.insert`). Never on the wire back.
    retain_s: float = 0.0

    @property
    def copies(self) -> int:
        return sum(s is not None for s in self.page_slots) + sum(s is not None for s in self.bounded_slots.values())


@dataclass(frozen=True)
class Shed:
    reason: str


@dataclass
class _Lease:
    req_id: str
    slots: list[int]  # the page slots it references (valid while it lives: a referenced entry is never evicted)
    bounded_key: bytes | None
    expires: float


class HostIndex:
    def __init__(
        self,
        page_slots: int,
        bounded_slots: dict[str, int] | None = None,
        *,
        required_bounded: Sequence[str] | None = None,
        high_watermark: float = 0.95,
        lease_ttl_s: float = 30.0,
        handoff_ttl_s: float = 300.0,
        save_ttl_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        slot_table: np.ndarray | None = None,
        max_remembered_revokes: int = 65536,
        eviction: str = HOST_DEFAULT,
        max_retain_s: float = 3600.0,
    ) -> None:
        if page_slots <= 0:
            raise ValueError(f"page_slots must be positive, got {page_slots}")
        self.page_slots = page_slots
        self.bounded_capacity = dict(bounded_slots or {})
        self.required = tuple(self.bounded_capacity if required_bounded is None else required_bounded)
        self.high_watermark = high_watermark
        self.lease_ttl_s, self.handoff_ttl_s, self.save_ttl_s = lease_ttl_s, handoff_ttl_s, save_ttl_s
        self.clock = clock
        self.free_pages: list[int] = list(range(page_slots - 1, -1, -1))
        # The page-slot table (`kvproc.tiers.slot_table`: each slot's generation, bumped when the slot is handed to
        # a save, and the save fences). Given: a view of the host arena's table, which copying processes map (a hit
        # names its slots' generations: a copy out of them checks them after, `TierSlots.intact`); else private.
        if slot_table is None:
            slot_table = np.zeros((ROWS, page_slots), dtype=np.int64)
        if slot_table.shape != (ROWS, page_slots) or slot_table.dtype != np.int64:
            raise ValueError(f"slot_table must be int64[{ROWS}, {page_slots}], got {slot_table.dtype}"
                             f"{list(slot_table.shape)}")
        slot_table[GEN] = secrets.randbits(40) << 20  # a random base per incarnation; room for 2**43 bumps a slot
        self._use_slot_table(slot_table)
        self.fences = FenceTable(slot_table[FENCE])
        # Saves given back (TTL, abort) while a copy still held their fence: their slots stay out of every free list
        # until the write is over and the fence is revoked (`save_fence.py`), retried by `reap`.
        self.quarantine: dict[int, SaveTicket] = {}
        self.free_bounded: dict[str, list[int]] = {g: list(range(n - 1, -1, -1)) for g, n in self.bounded_capacity.items()}
        self.entries: dict[bytes, int] = {}  # committed key -> its page slot
        self.slot_key: list[bytes | None] = [None] * page_slots
        self.refs = np.zeros(page_slots, dtype=np.int32)  # leases holding each slot's entry
        self.committed = np.zeros(page_slots, dtype=bool)  # the slot holds a committed entry
        self.lru_ok = np.zeros(page_slots, dtype=bool)  # committed and not pinned by a hand-off: evictable at 0 refs
        self.owners: dict[int, set[str]] = {}  # slot -> producer requests whose hand-off pins it
        self.bounded: dict[int, dict[str, int]] = {}  # slot -> {group: bounded slot} (checkpoint artifacts there)
        # Evictable slots in eviction order (`kvproc.core.eviction`: lrfu on the tier's clock by default, or LRU).
        self.lru = make_policy(eviction, page_slots, clock=clock)
        self.eviction = eviction
        # The longest a retention hint may rank a page ahead (`reserve_save(retain_s=...)`): a longer one is cut to it,
        # so no hint outranks every un-hinted page for longer than this (and a hint is never a pin: `lru.py`).
        if not max_retain_s >= 0:
            raise ValueError(f"max_retain_s must be >= 0, got {max_retain_s}")
        self.max_retain_s = max_retain_s
        self.pending: dict[bytes, int] = {}  # key -> save id that will commit it
        self.saves: dict[int, SaveTicket] = {}
        # Per open save: the slots of its pages that were already present (deduplicated), held like a lease until the
        # save settles, so that neither this save's room-making nor another save evicts the prefix its new pages
        # extend (they would be unreachable behind the hole).
        self._save_holds: dict[int, list[int]] = {}
        self.leases: dict[int, _Lease] = {}
        self.handoffs: dict[str, tuple[list[bytes], float]] = {}  # producer req -> (keys, expiry)
        # Revoked (or consumed) producers -> when to forget them (the hand-off TTL), oldest first. A revoke can reach
        # the tier before its hand-off's commit (a producer cancelled with saves in flight; a save deduplicated
        # against another producer's pages, so its consumer's full hit came first): a HANDOFF save of a producer
        # remembered here commits without pinning. Kept until expiry rather than dropped at the first commit, as a
        # producer may have several saves in flight. At most `max_remembered_revokes` (the oldest is forgotten,
        # counted).
        if max_remembered_revokes <= 0:
            raise ValueError(f"max_remembered_revokes must be positive, got {max_remembered_revokes}")
        self.max_remembered_revokes = max_remembered_revokes
        self.revoked: dict[str, float] = {}
        # Lease and save ids from a random base per index: an id a store kept from a tier that was replaced (a
        # `kvproc up` restarted on its runtime dir) never names a lease or save of the new one.
        self._ids = itertools.count((secrets.randbits(40) << 20) + 1)
        self.counters: Counter[str] = Counter()
        self.on_settled: Callable[[SaveTicket, bool], None] | None = None
        # KV events (`kv_events.py`), when the tier publishes them: appended here under the caller's lock, taken by
        # the role after each operation. None: off (no work at all on the hot paths).
        self.events: list[KvEvent] | None = None
        self.block_size = 0  # tokens per page, for BlockStored (the role reads it from the fingerprint)

    def _use_slot_table(self, table: np.ndarray) -> None:
        self.slot_table = table
        self.slot_gen = table[GEN]

    def detach_slot_table(self) -> None:
        """Keep going on a private copy of the table (the tier is stopping: its segment may unmap now)."""
        self._use_slot_table(self.slot_table.copy())
        self.fences.rebind(self.slot_table[FENCE])

    # -- query ----------------------------------------------------------------------------------------------------
    def query(self, req_id: str, hashes: Sequence[bytes]) -> QueryResult:
        """Longest committed run of `hashes` (from its start) ending at a complete checkpoint."""
        entries = self.entries
        n = len(list(takewhile(entries.__contains__, hashes)))
        depth = self._deepest_complete(hashes, n)
        if n < len(hashes) and hashes[n] in self.pending and depth == n:
            self.counters["query_loading"] += 1
            return Loading(ready_pages=n, save_id=self.pending[hashes[n]])
        if depth == 0:
            self.counters["query_miss"] += 1
            return Miss()
        slots = list(map(entries.__getitem__, hashes[:depth]))
        self._ref(slots)
        slot_gen = self.slot_gen
        lease_id = next(self._ids)
        last = self.bounded.get(slots[-1])
        self.leases[lease_id] = _Lease(req_id, slots, hashes[depth - 1] if last else None,
                                       self.clock() + self.lease_ttl_s)
        self.counters["query_hit"] += 1
        self.counters["query_hit_pages"] += depth
        return Hit(depth, lease_id, tuple(slots), dict(last or {}), tuple(slot_gen[slots].tolist()))

    def committed_run(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes`, from the start, are committed here (no lease taken)."""
        return len(list(takewhile(self.entries.__contains__, hashes)))

    def complete_depth(self, hashes: Sequence[bytes], n: int) -> int:
        """The deepest of the first `n` (committed) pages at which a query could hit: its checkpoint complete."""
        return self._deepest_complete(hashes, n)

    def lease_keys(self, req_id: str, keys: Sequence[bytes], ttl_s: float | None = None) -> tuple[int, list[int | None]]:
        """A lease on whichever of `keys` are committed (each slot's entry, and its bounded artifacts, then stay put
        until `release_lease`): the lease id and each key's slot (None: not here). For a reader of the slots that is
        not a store (the remote tier's write-behind); `ttl_s` defaults to the lease TTL."""
        slots = [self.entries.get(k) for k in keys]
        held = list(dict.fromkeys(s for s in slots if s is not None))
        if held:
            self._ref(held)
        lease_id = next(self._ids)
        self.leases[lease_id] = _Lease(req_id, held, None, self.clock() + (self.lease_ttl_s if ttl_s is None else ttl_s))
        return lease_id, slots

    def _deepest_complete(self, hashes: Sequence[bytes], n: int) -> int:
        if not self.required:
            return n
        for depth in range(n, 0, -1):
            bounded = self.bounded.get(self.entries[hashes[depth - 1]], {})
            if all(g in bounded for g in self.required):
                return depth
        return 0

    def _ref(self, slots: list[int]) -> None:
        """One more lease reference on each (distinct, committed) slot; the unreferenced ones leave the LRU."""
        if NATIVE is not None:
            left_lru, uncommitted = NATIVE.paged_acquire(self.refs, self.committed, self.lru.stamp, slots)
            assert not uncommitted, f"lease on uncommitted slots {uncommitted}"
            self.lru.removed(left_lru)
            return
        idx = np.asarray(slots, dtype=np.int64)
        self.lru.remove(idx[self.refs[idx] == 0])
        self.refs[idx] += 1

    def _unref(self, slots: list[int], retain_s: float = 0.0) -> None:
        """Drop one reference from each slot, last first: a chain's tail goes into the LRU (and out) before its
        shared head. Pinned (hand-off) entries stay out of the LRU. `retain_s`: the retention hint the slots that
        become evictable enter the policy with (0: none)."""
        if not slots:
            return
        if NATIVE is not None:
            to_lru, _pinned, underflow = NATIVE.paged_release(self.refs, self.lru_ok, slots)
            assert underflow is None, f"lease reference underflow on slots {underflow}"
            if to_lru:
                self._insert(to_lru, retain_s)
            return
        idx = np.asarray(slots, dtype=np.int64)[::-1]
        rc = self.refs[idx] - 1
        assert not (rc < 0).any(), "lease reference underflow"
        self.refs[idx] = rc
        zero = idx[rc == 0]
        self._insert(zero[self.lru_ok[zero]], retain_s)

    def _insert(self, slots: Any, retain_s: float) -> None:
        if retain_s:
            self.lru.insert(slots, retain_s)
            self.counters["pages_retain_hinted"] += len(slots)
        else:
            self.lru.insert(slots)  # exactly the call of an index that never heard of hints

    def _make_evictable(self, slots: Sequence[int], retain_s: float = 0.0) -> None:
        """Slots that may now be evicted (unpinned, or newly committed): into the LRU unless referenced or there."""
        self.lru_ok[list(slots)] = True
        stamp, refs = self.lru.stamp, self.refs
        back = [s for s in dict.fromkeys(slots) if not refs[s] and stamp[s] < 0]
        if back:
            self._insert(back, retain_s)

    def release_lease(self, lease_id: int, *, consume_handoff: str | None = None) -> bool:
        """Release a query's lease (idempotent: False if unknown or already released). `consume_handoff` names the
        producer request whose hand-off pins the consumer's completed load releases."""
        lease = self.leases.pop(lease_id, None)
        if consume_handoff is not None:
            self.revoke_handoff(consume_handoff, consumed=True)
        if lease is None:
            return False
        self._unref(lease.slots)
        return True

    # -- saves ----------------------------------------------------------------------------------------------------
    def reserve_save(
        self,
        req_id: str,
        keys: Sequence[bytes],
        bounded_groups: Sequence[str] = (),
        save_class: SaveClass = SaveClass.CACHEABLE,
        token_ids: Any = None,
        parent_key: bytes | None = None,
        retain_s: float | None = None,
    ) -> SaveTicket | Shed:
        """Reserve slots for the pages `keys` (and bounded artifacts at `keys[-1]`) not already present or pending.
        `token_ids` (the pages' tokens, `block_size` per page) go into the commit's BlockStored events, and
        `parent_key` (the prompt's page before `keys[0]`) is their first run's parent when it starts at `keys[0]`;
        both kept only while this index publishes events. `retain_s` (a retention hint: the request's conversation
        comes back within about that long; None or 0: none): every page of the save that becomes evictable at its
        commit (new, or present and held by it) ranks as if used `retain_s` (at most `max_retain_s`) later."""
        if not keys:
            raise ValueError("reserve_save needs at least one page key")
        retain = 0.0
        if retain_s is not None:
            if not retain_s >= 0:  # NaN and negatives refused: a hint must be a duration
                raise ValueError(f"retain_s must be a duration >= 0 (seconds) or None, got {retain_s!r}")
            retain = min(float(retain_s), self.max_retain_s)
            self.counters["saves_with_retain_hint"] += 1
        entries, pending = self.entries, self.pending
        new_pages = [k for k in keys if k not in entries and k not in pending]
        if retain:
            self._hint_pending(keys, retain)
        present = list(dict.fromkeys(entries[k] for k in keys if k in entries))
        last_slot = entries.get(keys[-1])
        have = self.bounded.get(last_slot, {}) if last_slot is not None else {}
        want_bounded = [g for g in bounded_groups if g not in have]
        if present:
            self._ref(present)  # held before making room: the save's own prefix is never the room
        if not self._make_room(len(new_pages), want_bounded):
            self._unref(present)
            self.counters[f"save_shed_{save_class.value}"] += 1
            return Shed(reason=f"host tier full: {len(new_pages)} page slots wanted, none evictable")
        fence = self.fences.issue()
        if fence is None:  # as many saves open as the table has fence words
            self._unref(present)
            self.counters[f"save_shed_{save_class.value}"] += 1
            return Shed(reason=f"host tier busy: {self.fences.open} saves open, no fence word free")
        new_set = set(new_pages)
        page_slots = tuple(self.free_pages.pop() if k in new_set else None for k in keys)
        slot_gen = self.slot_gen
        handed = [s for s in page_slots if s is not None]
        # Before the ticket goes out (so before any copy into these slots): the slots no longer hold what they held.
        slot_gen[handed] += 1  # distinct slots (all came off the free list)
        bounded: dict[str, int | None] = {g: None for g in bounded_groups}
        for g in want_bounded:
            bounded[g] = self.free_bounded[g].pop()
        on = self.events is not None  # what only events use is kept only for them
        ticket = SaveTicket(next(self._ids), req_id, save_class, tuple(keys), page_slots, bounded,
                            self.clock() + self.save_ttl_s, *fence, token_ids if on else None,
                            parent_key if on else None, retain)
        self.saves[ticket.save_id] = ticket
        if present:
            self._save_holds[ticket.save_id] = present
        for k in new_pages:
            pending[k] = ticket.save_id
        self.counters["saves_reserved"] += 1
        self.counters["save_dedup_pages"] += len(keys) - len(new_pages)
        return ticket

    def _hint_pending(self, keys: Sequence[bytes], retain: float) -> None:
        """A hinted save's pages that another save is still writing (an earlier seal of the request, still in flight
        when the hinted one is reserved) take the hint at that save's commit: it ranks its pages by the longer of the
        two hints. Without this they would enter the policy un-hinted, and the hinted prompt's tail would go first."""
        saves = self.saves
        for sid in {self.pending[k] for k in keys if k in self.pending}:
            t = saves.get(sid)
            if t is not None and t.retain_s < retain:
                t.retain_s = retain
                self.counters["saves_hinted_while_pending"] += 1

    def _make_room(self, pages: int, groups: Sequence[str]) -> bool:
        """Evict LRU entries until the reservation fits, and further down to the high watermark. Nothing is evicted
        for a save that cannot fit anyway (it is shed: evicting for it would only lose cached pages)."""
        if len(self.free_pages) + len(self.lru) < pages:
            return False
        target_free = max(pages, pages + self.page_slots - int(self.page_slots * self.high_watermark))
        short = min(target_free - len(self.free_pages), len(self.lru))
        if short > 0:
            for slot in self.lru.pop_oldest(short):  # oldest first, one call for the batch
                self._evict(slot)
        for g in groups:
            while not self.free_bounded[g] and self._evict_bounded(g):
                pass
        return len(self.free_pages) >= pages and all(self.free_bounded[g] for g in groups)

    def _evict(self, slot: int) -> None:
        """Drop the (unreferenced, unpinned) entry in `slot`, already taken out of the LRU."""
        key = self.slot_key[slot]
        assert key is not None
        del self.entries[key]
        if self.events is not None:
            self.events.append(BlockRemoved([key]))
        self.slot_key[slot] = None
        self.committed[slot] = self.lru_ok[slot] = False
        self.free_pages.append(slot)
        for g, bslot in self.bounded.pop(slot, {}).items():
            self.free_bounded[g].append(bslot)
        self.counters["evictions"] += 1

    def _evict_bounded(self, group: str) -> bool:
        for slot in self.lru:  # oldest first
            arts = self.bounded.get(slot)
            if arts and group in arts:
                self.free_bounded[group].append(arts.pop(group))
                if not arts:
                    del self.bounded[slot]
                self.counters["bounded_evictions"] += 1
                return True
        return False

    def commit_save(self, save_id: int) -> bool:
        """The copy landed: make every entry of the save visible at once. False -- the save's slots were given back
        (its TTL reaped it, or it was aborted), so its bytes may sit in slots another save owns: nothing becomes
        visible, and the store must count the save failed."""
        t = self.saves.pop(save_id, None)
        if t is None:
            q = self.quarantine.pop(save_id, None)
            if q is not None:  # its copy is over (the store commits after the copy's reply): retry the revoke now
                self._settle_quarantined(q)
            self.counters["commits_refused_reclaimed"] += 1
            return False
        if self.fences.revoke(t.fence, t.fence_token) != REVOKED:  # a copy still writes it (or it was revoked)
            self._abort(t)
            self.counters["commits_refused_fence"] += 1
            return False
        now = self.clock()
        entries, slot_key = self.entries, self.slot_key
        fresh: list[int] = []
        fresh_keys: list[bytes] = []
        for k, slot in zip(t.keys, t.page_slots):
            if slot is None:
                continue
            self.pending.pop(k, None)
            entries[k] = slot
            slot_key[slot] = k
            fresh.append(slot)
            fresh_keys.append(k)
        self.committed[fresh] = True
        if self.lru.wants_keys:
            self.lru.bind(fresh, fresh_keys)
        if self.events is not None and fresh_keys:
            self._stored_events(t)
        last = entries.get(t.keys[-1])
        for g, bslot in t.bounded_slots.items():
            if bslot is None:
                continue
            if last is None or g in self.bounded.get(last, {}):
                self.free_bounded[g].append(bslot)  # the page it belongs to is gone, or a duplicate
            else:
                self.bounded.setdefault(last, {})[g] = bslot
        if t.save_class is SaveClass.HANDOFF and t.req_id in self.revoked:
            # Its producer was revoked (or consumed) before this commit: nobody will read it, so it pins nothing
            # (its fresh entries become evictable below, like a cacheable save's).
            self.counters["handoffs_revoked_before_commit"] += 1
        elif t.save_class is SaveClass.HANDOFF:
            keys = [k for k in t.keys if k in entries]
            pinned = [entries[k] for k in keys]
            for slot in pinned:
                self.owners.setdefault(slot, set()).add(t.req_id)
            self.lru_ok[pinned] = False
            self.lru.remove(pinned)  # entries already present (deduplicated) may have been evictable
            old = self.handoffs.get(t.req_id, ([], 0.0))[0]
            self.handoffs[t.req_id] = (old + keys, now + self.handoff_ttl_s)
        self._make_evictable([s for s in reversed(fresh) if s not in self.owners], t.retain_s)  # tail first
        self._unref(self._save_holds.pop(save_id, []), t.retain_s)
        self.counters["saves_committed"] += 1
        self.counters["pages_saved"] += len(fresh)
        if self.on_settled:
            self.on_settled(t, True)
        return True

    def _stored_events(self, t: SaveTicket) -> None:
        """One BlockStored per run of consecutive pages this save added, parented on the prompt's page before it (the
        save's, or the one the store sent before the save's first: `parent_key`, None at the prompt's first page); with
        the run's token ids where the save brought them (`token_ids`: sliced here, listed by the publisher's
        thread as it encodes), else empty."""
        assert self.events is not None
        P, tokens = self.block_size, t.token_ids if self.block_size else None
        run: list[bytes] = []
        parent: bytes | None = None
        first = 0
        for i, (k, slot) in enumerate(zip(t.keys, t.page_slots)):
            if slot is not None:
                if not run:
                    parent, first = (t.keys[i - 1] if i else t.parent_key), i
                run.append(k)
            elif run:
                self.events.append(BlockStored(run, parent, page_token_ids(tokens, first, i, P), P))
                run = []
        if run:
            self.events.append(BlockStored(run, parent, page_token_ids(tokens, first, len(t.keys), P), P))

    def take_events(self) -> list[KvEvent]:
        """The events since the last call (under the caller's lock)."""
        if not self.events:
            return []
        out, self.events = self.events, []
        return out

    def abort_save(self, save_id: int, *, writer_dead: bool = False) -> bool:
        """The save will not commit: its pages stop being pending at once; its slots go back to the free lists once
        its fence is revoked (now, unless a copy still writes them: then they wait in `quarantine`). `writer_dead`:
        the store proved the worker that had the save's order dead, so a claim left on the fence is taken back."""
        t = self.saves.pop(save_id, None)
        if t is None:
            return False
        self._abort(t, writer_dead=writer_dead)
        return True

    def _abort(self, t: SaveTicket, *, writer_dead: bool = False) -> None:
        """`abort_save` of a ticket already taken out of `saves`."""
        self._unref(self._save_holds.pop(t.save_id, []))
        for k, slot in zip(t.keys, t.page_slots):
            if slot is not None:
                self.pending.pop(k, None)
        if writer_dead and self.fences.force_revoke(t.fence, t.fence_token):
            self.counters["fences_taken_from_dead_writers"] += 1
        self._settle_quarantined(t)
        self.counters["saves_aborted"] += 1
        if self.on_settled:
            self.on_settled(t, False)

    def _settle_quarantined(self, t: SaveTicket) -> None:
        """Free a settled save's slots if its fence can be revoked; else keep them out of use, in `quarantine`."""
        state = self.fences.revoke(t.fence, t.fence_token)
        if state == BUSY:
            if t.save_id not in self.quarantine:
                self.counters["saves_quarantined"] += 1
            self.quarantine[t.save_id] = t
            return
        self.quarantine.pop(t.save_id, None)
        for slot in t.page_slots:
            if slot is not None:
                self.free_pages.append(slot)
        for g, slot in t.bounded_slots.items():
            if slot is not None:
                self.free_bounded[g].append(slot)

    # -- hand-off -------------------------------------------------------------------------------------------------
    def revoke_handoff(self, producer_req_id: str, *, consumed: bool = False) -> bool:
        """Release a producer's hand-off pins ("nobody will read this", or the consumer's load completed), and
        remember the revoke until the hand-off TTL: a later commit of that producer's hand-off then pins nothing.
        False if no commit of it had pinned anything yet."""
        revoked = self.revoked
        if revoked.pop(producer_req_id, None) is None and len(revoked) >= self.max_remembered_revokes:
            del revoked[next(iter(revoked))]  # the oldest: its commit is the least likely still to come
            self.counters["revokes_forgotten_full"] += 1
        revoked[producer_req_id] = self.clock() + self.handoff_ttl_s  # (re)inserted last: the dict stays by expiry
        got = self.handoffs.pop(producer_req_id, None)
        if got is None:
            self.counters["revokes_of_unknown_handoff"] += 1  # remembered: its commit may come later
            return False
        free: list[int] = []
        for k in got[0]:
            slot = self.entries.get(k)
            owners = self.owners.get(slot) if slot is not None else None
            if owners is not None:
                owners.discard(producer_req_id)
                if not owners:
                    del self.owners[slot]  # type: ignore[arg-type]
                    free.append(slot)  # type: ignore[arg-type]
        self._make_evictable(free)
        self.counters["handoffs_consumed" if consumed else "handoffs_revoked"] += 1
        return True

    # -- TTL backstop ---------------------------------------------------------------------------------------------
    def reap(self) -> dict[str, list[str]]:
        """Reclaim expired leases, hand-offs and pending saves. Each reclaim is a bug elsewhere: counted, and the
        returned request ids are for the caller's log."""
        now = self.clock()
        out: dict[str, list[str]] = {"leases": [], "handoffs": [], "saves": []}
        for lid in [lid for lid, lease in self.leases.items() if lease.expires <= now]:
            out["leases"].append(self.leases[lid].req_id)
            self.release_lease(lid)
            self.counters["leases_reclaimed_by_ttl"] += 1
        for rid in [rid for rid, (_, exp) in self.handoffs.items() if exp <= now]:
            out["handoffs"].append(rid)
            self.revoke_handoff(rid)
            self.counters["handoffs_reclaimed_by_ttl"] += 1
        for sid in [sid for sid, t in self.saves.items() if t.expires <= now]:
            out["saves"].append(self.saves[sid].req_id)
            self.abort_save(sid)
            self.counters["saves_reclaimed_by_ttl"] += 1
        for t in list(self.quarantine.values()):  # writes that outlived their save: free once they are over
            self._settle_quarantined(t)
        revoked = self.revoked  # remembered revokes past the hand-off TTL (oldest first): forgotten, not a bug
        while revoked and (first := next(iter(revoked.items())))[1] <= now:
            del revoked[first[0]]
            self.counters["revokes_expired"] += 1
        return out

    # -- observability --------------------------------------------------------------------------------------------
    def stats(self) -> dict[str, int]:
        out = {
            "page_slots": self.page_slots,
            "free_page_slots": len(self.free_pages),
            "entries": len(self.entries),
            "evictable_entries": len(self.lru),
            "pending_pages": len(self.pending),
            "open_saves": len(self.saves),
            "open_leases": len(self.leases),
            "quarantined_saves": len(self.quarantine),
            "open_handoffs": len(self.handoffs),
            "remembered_revokes": len(self.revoked),
        }
        out.update(self.counters)
        return out
