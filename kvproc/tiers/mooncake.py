"""`MooncakeTier`: the tier below the host tier, on a Mooncake Store shared by many nodes, owned by the host-tier process
(`kvproc.tiers.host`): the store and the copy workers do not know it exists. It talks to the host tier through the
host's own `HostIndex`, under the host's lock, and moves bytes only between Mooncake and the host segment (registered
once with Mooncake's transfer engine; zero-copy batch calls, one Mooncake object per page).

Keys: `kvproc/<ns>/<fingerprint digest>/<page hash>` for a page (the bytes of every paged arena's unit, in the host
layout's region order), and `.../<page hash>/<group>` for a bounded group's checkpoint artifact at that page. Two
models (two fingerprints) never share a key; a namespace (`?ns=`) scopes a fleet or a tenant. A key's value is
written once and never changes: the page hash names its bytes, so a key that exists is not written again (checked
first: Mooncake's `put` of an existing key is a silent no-op, which would hide a refused write).

- **Write-behind**: the host tier hands each committed save's new pages (and artifacts) to `write_behind`, which
  leases their slots in the index at the commit (so they are neither evicted nor rewritten before Mooncake has read
  them: a full host tier sheds saves rather than lose pages Mooncake never got); a writer thread asks which keys
  Mooncake lacks (one batched existence check), writes those (`batch_put_from_multi_buffers`), releases the leases. Eviction from the host tier later keeps the Mooncake copy; Mooncake's own capacity and eviction govern it
  (a refused key is counted, `write_refused`).
- **Pull**: a query the host tier cannot answer in full (`probe`) asks Mooncake which of the missing pages it holds
  (one batched existence check of up to `max_pull_pages`), reserves host slots for the longest present run (an
  ordinary host save, so the query answers `Loading` and the store's resolve waits for its settlement as for any
  pending save), and pulls them into those slots (`batch_get_into_multi_buffers`) under the save's fence; the save
  commits when they land, or aborts.
- **Hand-offs** (`write_behind(done=...)`, a write-through): the keys a hand-off creates are written soft-pinned for
  the hand-off TTL and remembered per producer (`mooncake_pins.HandoffPins`); the producer's `revoke_handoff` removes
  them (never forced: a key under Mooncake's read lease is tried again after it). A full-hit wait on a key this tier
  lacks is `watch`ed: re-probed on a backoff (`mooncake_watch.KeyWatch`) and answered once the key is in Mooncake.
- **Faults**: every Mooncake call has a deadline (`OpRunner`) and one terminal outcome; a failure or timeout opens the
  breaker (`mooncake_client.Breaker`): while it is open no query waits on Mooncake (the resolve gets the host tier's
  answer) and write-behind is shed, counted. A pull that times out aborts its save (its slots stay quarantined by the
  fence until the call really ends: never wrong bytes).
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import structlog

from kvproc.tiers.deadline_ops import OK, TIMEOUT, OpRunner
from kvproc.tiers.host_index import HostIndex, QueryResult, SaveClass, SaveTicket, Shed
from kvproc.tiers.layout import HostLayout, Region
from kvproc.tiers.mooncake_client import (
    OBJECT_HAS_LEASE,
    OBJECT_NOT_FOUND,
    UNREACHABLE,
    Breaker,
    MooncakeClient,
    RemoteSpec,
)
from kvproc.tiers.mooncake_pins import HandoffPins
from kvproc.tiers.mooncake_watch import KeyWatch
from kvproc.tiers.save_fence import FenceRevoked, claim, release

log = structlog.get_logger("kvproc.mooncake")

REMOVE_ATTEMPTS = 3  # a revoked hand-off's removal: the first try, then after each read lease
WRITER = "mooncake-write-behind"  # the write-behind's lease owner (its leases show up under this request id)
PULLER = "mooncake-pull:"  # prefix of a pull's save request id


@dataclass
class _Pending:
    """One committed save's pages waiting for the writer, leased in the index (`lease`) until written."""

    lease: int
    items: list[tuple[bytes, int, tuple[str, ...]]]  # (page hash, its slot, artifact groups to write at it)
    new_pages: set[bytes]  # the pages whose bytes this save brought (others: only their new artifacts)
    done: Callable[[bool], None] | None = None  # a write-through's waiter: True once every key is in Mooncake
    producer: str = ""  # a write-through's hand-off producer (the keys it creates are soft-pinned for it)

    def finish(self, ok: bool) -> None:
        done, self.done = self.done, None
        if done is not None:
            done(ok)


def namespace(fingerprint: str, ns: str = "") -> str:
    digest = hashlib.blake2b(fingerprint.encode(), digest_size=10).hexdigest()
    return f"kvproc/{ns or 'default'}/{digest}"


class MooncakeTier:
    def __init__(self, spec: RemoteSpec, *, fingerprint: str, layout: HostLayout, segment_addr: int,
                 index: HostIndex, lock: threading.Lock, settled: Callable[[], None], max_pull_pages: int = 256,
                 write_batch_pages: int = 64, max_queued_pages: int = 65536,
                 key_found: Callable[[bytes], None] = lambda key: None,
                 key_wanted: Callable[[bytes], bool] = lambda key: False, handoff_ttl_s: float = 300.0) -> None:
        """`lock` guards `index` (the host tier's lock); `settled` answers the host tier's waiters after a pull's
        save settles (called without the lock). `key_found` / `key_wanted`: the host tier's full-hit waiters, for
        `watch` (called without the lock). `handoff_ttl_s`: how long a hand-off's keys stay soft-pinned in Mooncake
        unless its producer revokes it (the host tier's own hand-off TTL)."""
        self.spec = spec
        self.ns = namespace(fingerprint, spec.namespace)
        self.index, self.lock, self.settled = index, lock, settled
        self.timeout_s = spec.timeout_s
        self.max_pull_pages, self.write_batch_pages, self.max_queued_pages = (
            max_pull_pages, write_batch_pages, max_queued_pages)
        self.addr = segment_addr
        self.paged = [r for r in layout.regions if r.group not in layout.bounded_slots]
        self.bounded: dict[str, list[Region]] = {}
        for r in layout.regions:
            if r.group in layout.bounded_slots:
                self.bounded.setdefault(r.group, []).append(r)
        self.client = MooncakeClient(spec, segment_addr, layout.total_bytes)
        self.breaker = Breaker()
        self.counters: Counter[str] = Counter()
        self._reads = OpRunner("mooncake-reads")  # probes and pulls: never queued behind write-behind
        self._writes = OpRunner("mooncake-writes")
        self._queue: deque[_Pending] = deque()
        self._queued = 0  # pages in `_queue`
        self._cv = threading.Condition()
        self._closed = False
        self._in_flight = 0  # pages the writer has taken from the queue and not finished
        self._writer = threading.Thread(target=self._write_loop, name="kvproc-mooncake-writer", daemon=True)
        self._writer.start()
        self.pins = HandoffPins(handoff_ttl_s, self.counters)
        self._pins_lock = threading.Lock()
        self._timers: set[threading.Timer] = set()  # removals waiting out Mooncake's read lease
        self._watch = KeyWatch(self._watch_probe, key_found, key_wanted, self.counters)
        # Connect now (setup and registration take a while), not at the first query.
        self._reads.submit(lambda: self.client.exists([f"{self.ns}/connect"]), self.timeout_s * 5, self._connected,
                           what="connect")

    def _connected(self, outcome: str, result: Any) -> None:
        self.counters[f"connect_{outcome}"] += 1
        if outcome != OK:
            self.breaker.failure(f"connect: {result}")

    # ---- keys and buffers ----

    def page_key(self, h: bytes) -> str:
        return f"{self.ns}/{h.hex()}"

    def artifact_key(self, h: bytes, group: str) -> str:
        return f"{self.ns}/{h.hex()}/{group}"

    def _page_buffers(self, slot: int) -> tuple[list[int], list[int]]:
        return ([self.addr + r.offset + slot * r.unit_bytes for r in self.paged], [r.unit_bytes for r in self.paged])

    def _artifact_buffers(self, group: str, slot: int) -> tuple[list[int], list[int]]:
        rs = self.bounded[group]
        return [self.addr + r.offset + slot * r.unit_bytes for r in rs], [r.unit_bytes for r in rs]

    # ---- pull: a host-tier miss asks Mooncake ----

    def wants_probe(self, hashes: Sequence[bytes]) -> int:
        """Under the host's lock: where the probe would start (the first page the host tier lacks), or -1 when the
        host tier answers alone (it has every page, or the next one is pending already, or Mooncake is unreachable)."""
        if not self.breaker.closed:
            self.counters["probes_skipped_unreachable"] += 1
            return -1
        n = self.index.committed_run(hashes)
        if n == len(hashes) or hashes[n] in self.index.pending:
            return -1
        return n

    def probe(self, req_id: str, hashes: Sequence[bytes], start: int, timeout: float,
              answer: Callable[[QueryResult], bool], parent: bytes | None = None) -> None:
        """Ask Mooncake for `hashes[start:]` (one batched existence check), reserve and pull the longest present run,
        then `answer` the query from the index (Loading while the pull runs). `answer` returns False if the query's
        caller is gone (a Hit's lease is then given back). Without the host's lock; `answer` is called exactly once.
        `parent`: the prompt's page before `hashes[0]` (`Query.parent`), the pulled pages' parent in the KV events."""
        hashes = list(hashes)
        want = hashes[start:start + self.max_pull_pages]
        groups = list(self.index.required)
        keys = [self.page_key(h) for h in want] + [self.artifact_key(h, g) for h in want for g in groups]
        self.counters["probes"] += 1
        t0 = time.monotonic()

        def probed(outcome: str, codes: Any) -> None:
            self.counters["probe_ns"] += int((time.monotonic() - t0) * 1e9)
            run = 0
            if outcome == OK and any(c < 0 for c in codes):  # the check itself failed (e.g. -900: no master)
                outcome, codes = "failed", sorted(set(codes))
            if outcome != OK:
                self.counters[f"probes_{outcome}"] += 1
                self.breaker.failure(f"exists: {outcome} {codes!r}")
            else:
                self.breaker.success()
                run = self._present_run(list(codes), len(want), len(groups))
            ticket: SaveTicket | None = None
            with self.lock:
                if run:
                    ticket = self._reserve_pull(req_id, hashes[:start + run], parent)
                res = self.index.query(req_id, hashes)
            if not answer(res) and hasattr(res, "lease_id"):
                with self.lock:
                    self.index.release_lease(res.lease_id)
            if ticket is not None:
                self._pull(ticket)

        self._reads.submit(lambda: self.client.exists(keys), min(timeout, self.timeout_s), probed, what="exists")

    # ---- full-hit waits: a key another node is writing through ----

    def watch(self, key: bytes, deadline: float) -> bool:
        """A full-hit waiter parked on `key` (this tier lacks it): re-probe Mooncake for it until `deadline`
        (monotonic seconds), and answer its waiters once Mooncake has it (their resolve then queries again, which
        pulls it). False: not watched (the watch is full, counted)."""
        return self._watch.watch(key, deadline)

    def _watch_probe(self, keys: list[bytes], done: Callable[[set[bytes]], None]) -> None:
        """Which of `keys` Mooncake holds with every required artifact (one batched existence check)."""
        if not self.breaker.closed:
            self.counters["watch_skipped_unreachable"] += 1
            done(set())
            return
        groups = list(self.index.required)
        names = [self.page_key(h) for h in keys] + [self.artifact_key(h, g) for h in keys for g in groups]

        def probed(outcome: str, codes: Any) -> None:
            if outcome == OK and any(c < 0 for c in codes):
                outcome, codes = "failed", sorted(set(codes))
            if outcome != OK:
                self.counters[f"watch_probes_{outcome}"] += 1
                self.breaker.failure(f"exists: {outcome} {codes!r}")
                done(set())
                return
            self.breaker.success()
            n, g = len(keys), len(groups)
            done({h for i, h in enumerate(keys)
                  if codes[i] == 1 and all(codes[n + i * g + j] == 1 for j in range(g))})

        self._reads.submit(lambda: self.client.exists(names), self.timeout_s, probed, what="exists")

    def _present_run(self, codes: list[int], pages: int, groups: int) -> int:
        """The longest run of wanted pages Mooncake holds, cut back to the deepest page whose artifacts it holds too
        (a query hits only at a complete checkpoint)."""
        run = 0
        while run < pages and codes[run] == 1:
            run += 1
        if groups:
            art = codes[pages:]
            while run and not all(art[(run - 1) * groups + i] == 1 for i in range(groups)):
                run -= 1
        self.counters["probe_hit_pages"] += run
        if not run:
            self.counters["probes_missed"] += 1
        return run

    def _reserve_pull(self, req_id: str, keys: list[bytes], parent: bytes | None = None) -> SaveTicket | None:
        """Under the host's lock: host slots for the pages of `keys` the host tier lacks (again: it may have changed
        while Mooncake answered). None: nothing to pull, or no room (counted). `parent`: the prompt's page before
        `keys[0]` (a query's first page: the asking store sends it when this tier publishes KV events)."""
        n = self.index.committed_run(keys)
        if n == len(keys) or keys[n] in self.index.pending:
            return None
        t = self.index.reserve_save(PULLER + req_id, keys, list(self.index.required), SaveClass.CACHEABLE,
                                    parent_key=parent)
        if isinstance(t, Shed):
            self.counters["pulls_shed"] += 1
            return None
        return t

    def _pull(self, t: SaveTicket) -> None:
        keys: list[str] = []
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        for h, slot in zip(t.keys, t.page_slots):
            if slot is not None:
                p, s = self._page_buffers(slot)
                keys.append(self.page_key(h))
                ptrs.append(p)
                sizes.append(s)
        for g, bslot in t.bounded_slots.items():
            if bslot is not None:
                p, s = self._artifact_buffers(g, bslot)
                keys.append(self.artifact_key(t.keys[-1], g))
                ptrs.append(p)
                sizes.append(s)
        expect = [sum(s) for s in sizes]
        t0 = time.monotonic()

        def run() -> list[int]:
            row = self.index.fences.row  # read now: the tier rebinds it when it stops (no view kept past the call)
            claim(row, t.fence, t.fence_token)  # FenceRevoked: the save was given back, write nothing
            try:
                return self.client.get_into(keys, ptrs, sizes)
            finally:
                release(row, t.fence, t.fence_token)  # only once the call has really ended

        def pulled(outcome: str, codes: Any) -> None:
            ok = outcome == OK and list(codes) == expect
            with self.lock:
                committed = self.index.commit_save(t.save_id) if ok else self.index.abort_save(t.save_id)
            self.settled()
            if ok and committed:
                self.counters["pulls_ok"] += 1
                self.counters["pulled_pages"] += sum(s is not None for s in t.page_slots)
                self.counters["pulled_bytes"] += sum(expect)
                self.counters["pull_ns"] += int((time.monotonic() - t0) * 1e9)
                return
            self.counters["pulls_failed" if outcome != TIMEOUT else "pulls_timeout"] += 1
            if outcome == OK and any(c in UNREACHABLE for c in codes):
                self.breaker.failure(f"get: {codes}")
            elif outcome != OK and not isinstance(codes, FenceRevoked):
                self.breaker.failure(f"get: {outcome} {codes!r}")
            log.warning("mooncake_pull_failed", outcome=outcome, codes=codes if outcome == OK else repr(codes),
                        pages=len(keys), save_id=t.save_id)

        self._reads.submit(run, self.timeout_s, pulled, what="get_into")

    # ---- write-behind ----

    def write_behind(self, t: SaveTicket, done: Callable[[bool], None] | None = None) -> bool:
        """Under the host's lock, as a save commits: queue its new pages (and new artifacts, with the page they belong
        to), leased now so that the host tier cannot evict them before they are written (a full host tier then sheds
        saves instead of losing pages Mooncake never got). Shed at once, counted, while Mooncake is unreachable.

        `done` (a write-through: a hand-off's save): every page and artifact of the save is written or found present
        (not only the new ones), and `done(ok)` is called once from the writer thread. Returns False when nothing was
        queued (`done` is then not called)."""
        if t.req_id.startswith(PULLER):
            return False  # a pull's pages came from Mooncake
        through = done is not None
        hashes = list(dict.fromkeys(t.keys)) if through else \
            [h for h, slot in zip(t.keys, t.page_slots) if slot is not None]
        groups = tuple(g for g, b in t.bounded_slots.items() if through or b is not None)
        if groups and t.keys[-1] not in hashes:
            hashes.append(t.keys[-1])  # new artifacts at a page that was already here
        if not hashes:
            return False
        if not self.breaker.closed:
            self.counters["writes_shed_unreachable"] += len(hashes)
            return False
        lease, slots = self.index.lease_keys(WRITER, hashes, ttl_s=max(60.0, 4 * self.timeout_s))
        items = [(h, slot, groups if h == t.keys[-1] else ()) for h, slot in zip(hashes, slots) if slot is not None]
        new_pages = set(hashes) if through else {t.keys[i] for i, slot in enumerate(t.page_slots) if slot is not None}
        shed: list[_Pending] = []
        with self._cv:
            self._queue.append(_Pending(lease, items, new_pages, done, t.req_id if through else ""))
            self._queued += len(items)
            while self._queued > self.max_queued_pages and len(self._queue) > 1:
                old = self._queue.popleft()  # bounded: the oldest queued save is shed
                self._queued -= len(old.items)
                self.counters["writes_shed_queue_full"] += len(old.items)
                self.index.release_lease(old.lease)
                shed.append(old)
            self._cv.notify_all()  # the writer (and any `flush` waiting on the same condition)
        for old in shed:
            old.finish(False)
        return True

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                batch: list[_Pending] = []
                # A batch is all write-throughs or none: a write-through's new keys are written soft-pinned.
                while self._queue and (not batch or sum(len(p.items) for p in batch) < self.write_batch_pages) and \
                        (not batch or (self._queue[0].done is None) == (batch[0].done is None)):
                    batch.append(self._queue.popleft())
                n = sum(len(p.items) for p in batch)
                self._queued -= n
                self._in_flight = n
            try:
                self._write(batch)
            except Exception:  # noqa: BLE001 - the writer must outlive any one batch
                self.counters["writes_failed"] += n
                log.exception("mooncake_write_behind_failed", pages=n)
                self._unlease(batch)
            finally:
                with self._cv:
                    self._in_flight = 0
                    self._cv.notify_all()  # `flush` waits on it

    def _unlease(self, batch: list[_Pending], ok: dict[int, bool] | None = None) -> None:
        """The batch's leases back; then each write-through hears whether all its keys are in Mooncake."""
        with self.lock:
            for p in batch:
                self.index.release_lease(p.lease)  # idempotent
        for i, p in enumerate(batch):
            p.finish(bool(ok and ok.get(i, False)))

    def _write(self, batch: list[_Pending]) -> None:
        if not self.breaker.closed:
            self.counters["writes_shed_unreachable"] += sum(len(p.items) for p in batch)
            self._unlease(batch)
            return
        keys: list[str] = []
        ptrs: list[list[int]] = []
        sizes: list[list[int]] = []
        owner: list[int] = []  # the batch entry each key belongs to
        ok = {i: True for i in range(len(batch))}  # which entries end with all their keys in Mooncake
        with self.lock:
            entries, bounded = self.index.entries, self.index.bounded
            for i, p in enumerate(batch):
                for h, slot, groups in p.items:
                    if entries.get(h) != slot:  # its lease was reaped (TTL) and the slot reused: not these bytes
                        self.counters["writes_lost_lease"] += 1
                        ok[i] = False
                        continue
                    if h in p.new_pages:
                        buf, size = self._page_buffers(slot)
                        keys.append(self.page_key(h))
                        ptrs.append(buf)
                        sizes.append(size)
                        owner.append(i)
                    arts = bounded.get(slot, {})
                    for g in groups:
                        if g in arts:
                            buf, size = self._artifact_buffers(g, arts[g])
                            keys.append(self.artifact_key(h, g))
                            ptrs.append(buf)
                            sizes.append(size)
                            owner.append(i)
                        elif p.done is not None:
                            ok[i] = False  # a hand-off's artifact this tier no longer holds
        if not keys:
            self._unlease(batch, ok)
            return
        outcome, codes = self._writes.call(lambda: self.client.exists(keys), self.timeout_s, what="exists")
        if outcome == OK and any(c < 0 for c in codes):
            outcome, codes = "failed", sorted(set(codes))
        if outcome != OK:
            self._unlease(batch)
            self.breaker.failure(f"exists: {outcome} {codes!r}")
            self.counters["writes_shed_unreachable"] += len(keys)
            return
        todo = [i for i, c in enumerate(codes) if c != 1]
        self.counters["writes_present"] += len(keys) - len(todo)
        if not todo:
            self._unlease(batch, ok)
            return
        k2, p2, s2 = [keys[i] for i in todo], [ptrs[i] for i in todo], [sizes[i] for i in todo]
        pin_s = self.pins.ttl_s if batch[0].done is not None else 0.0
        t0 = time.monotonic()
        outcome, codes = self._writes.call(lambda: self.client.put_from(k2, p2, s2, soft_pin_s=pin_s), self.timeout_s,
                                           on_late=lambda *_: self._unlease(batch), what="put_from")
        if outcome == TIMEOUT:  # the call still reads the slots: the leases go back when it ends (`on_late`)
            self.breaker.failure("put_from: timeout")
            self.counters["writes_shed_unreachable"] += len(k2)
            return
        if outcome != OK:
            self._unlease(batch)
            self.breaker.failure(f"put_from: {codes!r}")
            self.counters["writes_shed_unreachable"] += len(k2)
            return
        created: dict[str, list[str]] = {}
        for i, c in zip(todo, codes):
            if c != 0:
                ok[owner[i]] = False
            elif pin_s:
                created.setdefault(batch[owner[i]].producer, []).append(keys[i])
        for producer, made in created.items():  # before the write-throughs are answered: a revoke may follow
            with self._pins_lock:
                revoked = self.pins.record(producer, made)
            if revoked:
                self._remove(producer, revoked)
        self._unlease(batch, ok)
        self.counters["write_ns"] += int((time.monotonic() - t0) * 1e9)
        for c, s in zip(codes, s2):
            if c == 0:
                self.counters["writes_ok"] += 1
                self.counters["written_bytes"] += sum(s)
            elif c in UNREACHABLE:
                self.counters["writes_shed_unreachable"] += 1
            else:
                self.counters["writes_refused"] += 1  # Mooncake's capacity or policy said no: its call
        if any(c in UNREACHABLE for c in codes):
            self.breaker.failure(f"put_from: {sorted(set(codes))}")

    # ---- a hand-off's revoke ----

    def revoke_handoff(self, producer: str) -> None:
        """The producer's revoke reached this tier: remove the keys its write-through created (soft-pinned) from
        Mooncake, so that no node pulls a hand-off nobody will read and its capacity is free again."""
        with self._pins_lock:
            keys = self.pins.revoke(producer)
        if keys:
            self._remove(producer, keys)

    def _remove(self, producer: str, keys: list[str], attempt: int = 1) -> None:
        """Never forced (`MooncakeClient.remove`): a key leased by a recent read or existence check is removed again
        once the lease has run out (`lease_ttl`), up to `REMOVE_ATTEMPTS` times; then its soft pin lapses at the
        TTL (counted)."""

        def removed(outcome: str, codes: Any) -> None:
            if outcome != OK:
                self.counters["handoff_remove_failed"] += len(keys)
                if outcome != "closed":
                    self.breaker.failure(f"remove: {outcome} {codes!r}")
                return
            busy = [k for k, c in zip(keys, codes) if c == OBJECT_HAS_LEASE]
            self.counters["handoff_keys_removed"] += sum(c == 0 for c in codes)
            self.counters["handoff_keys_gone"] += sum(c == OBJECT_NOT_FOUND for c in codes)  # evicted already
            self.counters["handoff_remove_failed"] += sum(c not in (0, OBJECT_NOT_FOUND, OBJECT_HAS_LEASE)
                                                          for c in codes)
            if not busy:
                return
            if attempt >= REMOVE_ATTEMPTS:
                self.counters["handoff_remove_gave_up"] += len(busy)
                log.warning("mooncake_handoff_remove_gave_up", producer=producer, keys=len(busy))
                return
            self.counters["handoff_remove_retried"] += len(busy)
            self._later(self.spec.lease_ttl_s + 0.2, lambda: self._remove(producer, busy, attempt + 1))

        self._writes.submit(lambda: self.client.remove(keys), self.timeout_s, removed, what="remove")

    def _later(self, delay: float, fn: Callable[[], None]) -> None:
        def run() -> None:
            with self._cv:
                self._timers.discard(timer)
                if self._closed:
                    return
            fn()

        timer = threading.Timer(delay, run)
        timer.daemon = True
        with self._cv:
            if self._closed:
                return
            self._timers.add(timer)
        timer.start()

    # ---- observability and shutdown ----

    def flush(self, timeout: float) -> bool:
        """Wait until the write-behind queue is empty (tests, benchmarks). False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._in_flight, timeout)

    def stats(self) -> dict[str, int]:
        # list(): one C call under the GIL (the runner and writer threads add keys meanwhile)
        out = {f"remote.{k}": int(v) for k, v in list(self.counters.items())}
        out["remote.queued_pages"] = self._queued + self._in_flight
        out["remote.reachable"] = int(self.breaker.closed)
        out["remote.connected"] = int(self.client.connected)
        out["remote.breaker_opened"] = self.breaker.opened
        with self._pins_lock:
            self.pins.expire()
            out["remote.handoffs_pinned"] = self.pins.producers
        out["remote.watching"] = self._watch.watching
        for name, runner in (("reads", self._reads), ("writes", self._writes)):
            for k, v in runner.outcomes.items():
                out[f"remote.ops_{name}_{k}"] = v
        return out

    def close(self) -> None:
        with self._cv:
            self._closed = True
            left, self._queue = list(self._queue), deque()
            self.counters["writes_shed_closing"] += self._queued
            self._queued = 0
            timers, self._timers = self._timers, set()
            self._cv.notify_all()
        for timer in timers:
            timer.cancel()
        self._unlease(left)  # write-throughs waiting on them hear False
        self._watch.close()
        self._reads.close()
        self._writes.close()
        self._writer.join(self.timeout_s * 2)
        if not (self._reads.join(self.timeout_s * 2) and self._writes.join(self.timeout_s * 2)):
            log.warning("mooncake_close_left_call_running")  # the process exit ends it; closing under it would not
            return
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - the store may be gone already
            log.warning("mooncake_close_failed", exc_info=True)
