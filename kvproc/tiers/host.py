"""`HostTierRole`: the host-memory tier as its own process (no torch): one `HostIndex`, one shared-memory arena.

The first engine sends `Configure(fingerprint, layout)`; the tier creates its segment (`layout.total_bytes`, refused
when larger than the `host_bytes` option) and answers the segment's name. A later `Configure` with the same
fingerprint joins it (same segment, same layout); a different fingerprint is refused with both strings.

Host arena layout (the segment `kvproc.<cluster>.host_tier.<pid>.<n>`, planned by `kvproc.tiers.layout.HostLayout`):
one region per stored device arena, in the model's arena order, each starting on a 4 KiB boundary:

    offset 0                                     region(kv0)                 region(kv1)   ...  region(st0) ...  table
    | unit 0 | unit 1 | ... | unit page_slots-1 | pad | unit 0 | ...          | ...          | bounded ... | table

- a **page slot** `s` is unit `s` of every paged arena's region (one page of every aligned paged group);
- a **bounded slot** `s` of group `g` is unit `s` of every arena of `g`;
- a unit is the arena's *stored* bytes per block (`stored_bytes_per_block`: the repacked size where the model
  declares one); non-checkpointable bounded groups have no region;
- `table` (at `layout.slot_table_offset`) is the index's page-slot table (`kvproc.tiers.slot_table`: generations and
  save fences), written only here (`HostIndex.slot_table` is a view of it); the processes that copy pages read it.
The index hands out slot numbers; copy workers map the same segment and turn (slot, arena) into a byte offset with the
same `HostLayout`. No KV byte ever crosses a socket: requests carry hashes, slots, lease and save ids.

Threads: handlers run on the server's pool; every `HostIndex` access holds `self._lock`. Waiters (`WaitSettled`,
`WaitKey`) are deferred calls: the index's `on_settled` answers them, and the timer thread answers the rest at their
deadline with `Waited(False)` (and runs the TTL reaper). At shutdown every waiter fails.
"""

from __future__ import annotations

import heapq
import itertools
import re
import secrets
import threading
import time
from collections import defaultdict
from typing import Any

import numpy as np
import structlog

from kvproc.core.eviction import HOST_DEFAULT, POLICIES
from kvproc.ipc import messages as m
from kvproc.ipc.context import CallContext, Deferred
from kvproc.ipc.errors import HandlerError
from kvproc.ipc.segment import Segment
from kvproc.ipc.service import handles
from kvproc.runtime.event_interval import DEFAULT_INTERVAL_S, interval_ms
from kvproc.runtime.role import Role, RoleEnv
from kvproc.tiers.host_index import Hit, HostIndex, Loading, Miss, QueryResult, SaveClass, SaveTicket
from kvproc.tiers.kv_events import AllBlocksCleared, KvEventPublisher
from kvproc.tiers.layout import HostLayout, Region
from kvproc.tiers.mooncake import MooncakeTier
from kvproc.tiers.mooncake_client import RemoteSpec
from kvproc.tiers.reservations import Reservations
from kvproc.tiers.save_fence import DEFAULT_COPY_TIMEOUT_S, derived_save_ttl
from kvproc.tiers.slot_table import ROWS

log = structlog.get_logger("kvproc.host_tier")


def layout_to_wire(layout: HostLayout) -> m.HostLayoutSpec:
    regions = [m.RegionSpec(r.arena, r.group, r.offset, r.unit_bytes, r.slots) for r in layout.regions]
    return m.HostLayoutSpec(regions, layout.page_slots, dict(layout.bounded_slots), layout.total_bytes,
                            layout.slot_table_offset)


def layout_from_wire(spec: m.HostLayoutSpec) -> HostLayout:
    regions = tuple(Region(r.arena, r.group, r.offset, r.unit_bytes, r.slots) for r in spec.regions)
    return HostLayout(regions, spec.page_slots, dict(spec.bounded_slots), spec.total_bytes, spec.slot_table_offset)


def _query_answer(res: QueryResult) -> m.TierMiss | m.TierLoading | m.TierHit:
    if isinstance(res, Hit):
        return m.TierHit(res.pages, res.lease_id, list(res.page_slots), dict(res.bounded_slots), list(res.page_gens))
    if isinstance(res, Loading):
        return m.TierLoading(res.ready_pages, res.save_id)
    return m.TierMiss()


class _Waiter:
    __slots__ = ("ctx", "table", "key")

    def __init__(self, ctx: CallContext, table: dict[Any, list[_Waiter]], key: Any) -> None:
        self.ctx, self.table, self.key = ctx, table, key


class HostTierRole(Role):
    name = "host_tier"
    # Index work is short dict operations under `self.lock`, and the waits defer at once: run them on the socket
    # thread (no handler-pool hop). Configure (creates a segment) and stats stay on the pool.
    inline = frozenset({m.Query, m.ReleaseLease, m.RevokeHandoff, m.ReserveSave, m.CommitSave, m.AbortSave,
                        m.WaitSettled, m.WaitKey})

    def __init__(self, env: RoleEnv) -> None:
        super().__init__(env)
        opts = env.options
        self.host_bytes = int(opts.get("host_bytes", 0))
        self.lease_ttl_s = float(opts.get("lease_ttl_s", 30.0))
        self.handoff_ttl_s = float(opts.get("handoff_ttl_s", 300.0))
        # Default: outlives the default copy deadline of the stores that may share this tier (`kvproc up`).
        self.save_ttl_s = float(opts.get("save_ttl_s") or derived_save_ttl(DEFAULT_COPY_TIMEOUT_S))
        self.reap_interval_s = float(opts.get("reap_interval_s", 1.0))
        # `kvproc up --eviction`: this tier's own policy, whatever its stores ask for (several share it). Unset (a
        # tier a store's cluster started for it alone): the first Configure's (`StoreConfig.eviction`), else LRU.
        self.eviction = str(opts.get("eviction") or "")
        if self.eviction and self.eviction not in POLICIES:
            raise ValueError(f"host tier: unknown eviction policy {self.eviction!r} (known: {', '.join(POLICIES)})")
        if nbytes := int(opts.get("segment_bytes", 0)):
            self.create_segment(nbytes)  # scratch segment (runtime tests of segment clean-up)
        self._lock = threading.Lock()
        self.index: HostIndex | None = None
        self.fingerprint = ""
        self.layout: HostLayout | None = None
        self.segment: Segment | None = None
        self._configured: m.Configured | None = None
        # Deferred waiters: by save id / by key, plus one deadline heap the timer thread serves.
        self._save_waiters: dict[int, list[_Waiter]] = defaultdict(list)
        self._key_waiters: dict[bytes, list[_Waiter]] = defaultdict(list)
        self._deadlines: list[tuple[int, int, _Waiter]] = []
        self._seq = itertools.count()
        self._settled: list[tuple[SaveTicket, bool]] = []  # filled by on_settled under the lock, answered after
        # Reserves whose store gave up on them (their ticket never reached it): found and aborted, or refused.
        self.reservations = Reservations(self.save_ttl_s, time.monotonic)
        # The same bookkeeping for queries: a lease made for a query its store gave up on (`Query.claim`)
        self.query_claims = Reservations(self.save_ttl_s, time.monotonic)
        self.incarnation = secrets.randbits(62) | 1  # `Configured.incarnation`: never 0 (0 is "not said")
        self._wake = threading.Condition(self._lock)
        self._stopping = False
        # KV events for routers (`kv_events.py`): off unless the `kv_events` option asks.
        self.events: KvEventPublisher | None = None
        self.events_tokens = False
        if opts.get("kv_events"):
            self.events = KvEventPublisher(env.runtime_dir, env.rank,
                                           batch_interval_s=opts.get("kv_events_interval_s", DEFAULT_INTERVAL_S))
            self.published.update(kv_events=self.events.pub_endpoint, kv_events_replay=self.events.replay_endpoint,
                                  kv_events_interval_ms=interval_ms(self.events.batch_interval_s))
            # Token ids in BlockStored (`kv_events_tokens`): the stores send each save's tokens with its ReserveSave
            # (they learn it from `Configured.token_ids`); off, the save path carries nothing more than before.
            self.events_tokens = bool(opts.get("kv_events_tokens"))
            self.published["kv_events_tokens"] = "1" if self.events_tokens else "0"  # routers: token ids coming?
            # test-only (`tests/tiers/test_kv_event_failures.py`): the first N batches fail to encode, for real
            self.events.test_only_poison_batches = int(opts.get("test_only_poison_kv_event_batches", 0))
        # The tier below this one (`mooncake.py`): off unless the `remote` option names a Mooncake Store. Parsed
        # here so that a bad URL fails the tier's start; connected at Configure (it needs the segment and the model).
        self.remote_spec = RemoteSpec.parse(opts["remote"]) if opts.get("remote") else None
        self.remote: MooncakeTier | None = None
        self._timer = threading.Thread(target=self._timer_main, name="kvproc-host-timer", daemon=True)
        self._timer.start()

    # ---- configuration ----

    @handles(m.Configure)
    def configure(self, msg: m.Configure, ctx: CallContext) -> m.Configured:
        with self._lock:
            if self._configured is not None:
                if msg.fingerprint != self.fingerprint:
                    self.counters.inc("configure_refused")
                    raise HandlerError(
                        "fingerprint_mismatch",
                        f"host tier is configured for {self.fingerprint!r}; refused {msg.fingerprint!r}",
                    )
                self.counters.inc("configure_joined")
                return self._configured
            layout = layout_from_wire(msg.layout)
            if self.host_bytes and layout.total_bytes > self.host_bytes:
                raise HandlerError(
                    "too_large",
                    f"host layout needs {layout.total_bytes} B, more than this tier's host_bytes={self.host_bytes}",
                )
            seg = self.create_segment(layout.total_bytes)
            table = None
            if layout.slot_table_offset >= 0:
                table = seg.numpy(np.int64, layout.slot_table_offset, ROWS * layout.page_slots).reshape(ROWS, -1)
            eviction = self.eviction or msg.eviction or HOST_DEFAULT
            if eviction not in POLICIES:
                raise HandlerError("bad_eviction", f"unknown eviction policy {eviction!r} (known: "
                                                   f"{', '.join(POLICIES)})")
            index = HostIndex(layout.page_slots, dict(layout.bounded_slots), required_bounded=msg.required_bounded,
                              lease_ttl_s=self.lease_ttl_s, handoff_ttl_s=self.handoff_ttl_s,
                              save_ttl_s=self.save_ttl_s, slot_table=table, eviction=eviction)
            index.on_settled = self._on_settled
            if self.events is not None:
                index.events = [AllBlocksCleared()]  # a new incarnation holds nothing: subscribers start over
                page = re.search(r"\bpage=(\d+)", msg.fingerprint)
                index.block_size = int(page[1]) if page else 0
                self._publish_locked(index)
            self.index, self.layout, self.segment, self.fingerprint = index, layout, seg, msg.fingerprint
            if self.remote_spec is not None:
                self.remote = MooncakeTier(self.remote_spec, fingerprint=msg.fingerprint, layout=layout,
                                           segment_addr=seg.address(), index=index, lock=self._lock,
                                           settled=self._answer_settled, key_found=self._key_landed_remote,
                                           key_wanted=self._key_awaited, handoff_ttl_s=self.handoff_ttl_s)
            self._configured = m.Configured(seg.name, msg.layout, msg.fingerprint, self.events_tokens,
                                            self.events is not None, self.incarnation, index.eviction)
            self.counters.inc("configured")
            log.info("host_tier_configured", fingerprint=msg.fingerprint, segment=seg.name,
                     bytes=layout.total_bytes, page_slots=layout.page_slots, bounded=layout.bounded_slots)
            return self._configured

    def _index(self) -> HostIndex:
        if self.index is None:
            raise HandlerError("not_configured", "host tier has no layout yet: send Configure first")
        return self.index

    # ---- queries and leases ----

    @handles(m.Query)
    def query(self, msg: m.Query, ctx: CallContext) -> m.TierMiss | m.TierLoading | m.TierHit | Deferred:
        remote = self.remote
        with self._lock:
            if msg.claim and self.query_claims.refuse(msg.claim):  # its store gave up on it before it arrived
                self._index().counters["queries_refused_abandoned"] += 1
                return m.TierMiss()
            start = remote.wants_probe(msg.hashes) if remote is not None else -1
            if start < 0:
                res = self._claimed(msg.claim, self._index().query(msg.req_id, msg.hashes))
        if remote is not None and start >= 0:  # pages this tier lacks: ask Mooncake, answer once it has answered
            def answer(r: QueryResult) -> bool:
                with self._lock:
                    r = self._claimed(msg.claim, r)
                return ctx.ok(_query_answer(r))

            remote.probe(msg.req_id, msg.hashes, start, ctx.remaining(), answer, msg.parent)
            return ctx.defer()
        return _query_answer(res)

    def _claimed(self, claim: int, res: QueryResult) -> QueryResult:
        """A Hit's lease under its query's claim (under the lock); a claim abandoned meanwhile releases it: a miss."""
        if claim and isinstance(res, Hit):
            if self.query_claims.refuse(claim):
                self._index().release_lease(res.lease_id)
                self._index().counters["queries_refused_abandoned"] += 1
                return Miss()
            self.query_claims.opened(claim, res.lease_id)
        return res

    @handles(m.ReleaseLease)
    def release_lease(self, msg: m.ReleaseLease, ctx: CallContext) -> m.Done:
        with self._lock:
            index = self._index()
            if msg.claim:  # by the query's claim: its store gave up on the query (its lease, or the query later)
                lease_id = self.query_claims.abandon(msg.claim)
                if lease_id is not None and index.release_lease(lease_id):
                    index.counters["leases_released_abandoned"] += 1
                    log.info("abandoned_lease_released", lease_id=lease_id, claim=msg.claim)
            else:
                index.release_lease(msg.lease_id, consume_handoff=msg.consume_handoff or None)
                self.query_claims.settled(msg.lease_id)
        return m.Done()

    @handles(m.RevokeHandoff)
    def revoke_handoff(self, msg: m.RevokeHandoff, ctx: CallContext) -> m.Done:
        with self._lock:
            self._index().revoke_handoff(msg.req_id, consumed=msg.consumed)
        if self.remote is not None and not msg.consumed:
            self.remote.revoke_handoff(msg.req_id)  # what its write-through put in Mooncake goes too
        return m.Done()

    # ---- saves ----

    @handles(m.ReserveSave)
    def reserve_save(self, msg: m.ReserveSave, ctx: CallContext) -> m.TierSaveTicket | m.TierShed:
        try:
            save_class = SaveClass(msg.save_class)
        except ValueError:
            raise HandlerError("bad_request", f"unknown save class {msg.save_class!r}") from None
        if msg.retain_s is not None and not 0 <= msg.retain_s < float("inf"):
            raise HandlerError("bad_request", f"retain_s must be a finite duration >= 0, got {msg.retain_s!r}")
        with self._lock:
            index = self._index()
            if msg.reservation and self.reservations.refuse(msg.reservation):  # its store gave up on it first
                index.counters["reserves_refused_abandoned"] += 1
                return m.TierShed("reservation abandoned by its store before it arrived")
            # `events`: the parent page and token ids for our KV events (a store sends them once our `Configured`
            # said kv_events / token_ids); None: nothing for them.
            ev = msg.events
            raw, parent = (ev.token_ids, ev.parent_key) if ev is not None else (None, None)
            tokens = np.frombuffer(raw, np.int64) if raw and self.events_tokens else None
            t = index.reserve_save(msg.req_id, msg.keys, msg.bounded_groups, save_class, tokens, parent,
                                   msg.retain_s)
            if isinstance(t, SaveTicket):
                self.reservations.opened(msg.reservation, t.save_id)
            self._publish_locked(index)  # making room evicts
        if not isinstance(t, SaveTicket):
            return m.TierShed(t.reason)
        return m.TierSaveTicket(t.save_id, t.req_id, t.save_class.value, list(t.keys), list(t.page_slots),
                                dict(t.bounded_slots), t.expires, t.fence, t.fence_token)

    @handles(m.CommitSave)
    def commit_save(self, msg: m.CommitSave, ctx: CallContext) -> m.Done | Deferred:
        through = False
        with self._lock:
            index = self._index()
            ticket = index.saves.get(msg.save_id)
            committed = index.commit_save(msg.save_id)
            self._publish_locked(index)
            if committed and ticket is not None and self.remote is not None:
                if ticket.save_class is SaveClass.HANDOFF:  # written through: answered once Mooncake has it all
                    through = self.remote.write_behind(ticket, lambda ok: self._written_through(ticket, ok, ctx))
                    if not through:
                        self.remote.counters["handoff_write_through_failed"] += 1
                else:
                    self.remote.write_behind(ticket)  # the new pages go to Mooncake in the background
        self._answer_settled()
        if not committed:
            self.counters.inc("commit_unknown_save")  # reclaimed (TTL, abort) before the copy's commit came
            raise HandlerError("save_reclaimed", f"save {msg.save_id} was given back before its commit: its copy "
                                                 "may not stand, nothing was committed")
        if through:
            # The commit itself stands: if the write takes longer than the caller waits, it is answered before its
            # deadline anyway (the hand-off then stays pinned here only; counted when the write ends badly).
            timer = threading.Timer(max(ctx.remaining() * 0.8, 0.0), lambda: ctx.ok(m.Done()))
            timer.daemon = True
            timer.start()
            return ctx.defer()
        return m.Done()

    def _written_through(self, ticket: SaveTicket, ok: bool, ctx: CallContext) -> None:
        """A hand-off save's pages are all in Mooncake (`ok`), or could not be written. Once they are, the hand-off's
        pin moves there: this tier releases its own (its pages stay here as cacheable entries), so a decode on another
        node, which consumes through its own tier, leaves nothing pinned on this one."""
        if ok:
            with self._lock:
                if self.index is not None:
                    self.index.revoke_handoff(ticket.req_id)
        counters = self.remote.counters if self.remote is not None else None
        if counters is not None:
            counters["handoffs_written_through" if ok else "handoff_write_through_failed"] += 1
        ctx.ok(m.Done())

    @handles(m.AbortSave)
    def abort_save(self, msg: m.AbortSave, ctx: CallContext) -> m.Done:
        with self._lock:
            index = self._index()
            if msg.save_id:
                index.abort_save(msg.save_id, writer_dead=msg.writer_dead)
            if msg.reservation:
                save_id = self.reservations.abandon(msg.reservation)
                if save_id is not None and index.abort_save(save_id, writer_dead=msg.writer_dead):
                    # A save that would otherwise have stayed open, its pages "Loading" for everyone, to its TTL.
                    index.counters["saves_aborted_abandoned"] += 1
                    log.info("abandoned_save_aborted", save_id=save_id, reservation=msg.reservation)
                elif save_id is None:
                    index.counters["reservations_abandoned_unseen"] += 1  # remembered: refused if it still comes
        self._answer_settled()
        return m.Done()

    # ---- waiters (deferred replies) ----

    @handles(m.WaitSettled)
    def wait_settled(self, msg: m.WaitSettled, ctx: CallContext) -> m.Waited | Deferred:
        with self._lock:
            if msg.save_id not in self._index().saves:
                return m.Waited(True)
            self._park(ctx, self._save_waiters, msg.save_id)
        return ctx.defer()

    @handles(m.WaitKey)
    def wait_key(self, msg: m.WaitKey, ctx: CallContext) -> m.Waited | Deferred:
        with self._lock:
            if msg.key in self._index().entries:
                return m.Waited(True)
            self._park(ctx, self._key_waiters, msg.key)
        if self.remote is not None:
            # A full-hit wait (a hand-off produced on another node) is answered when the key lands in Mooncake too:
            # nothing brings it into this tier by itself, only the resolve's next query pulls it.
            self.remote.watch(msg.key, ctx.deadline_ns / 1e9)
        return ctx.defer()

    def _key_awaited(self, key: bytes) -> bool:
        with self._lock:
            return bool(self._key_waiters.get(key))

    def _key_landed_remote(self, key: bytes) -> None:
        """Mooncake has `key` (and its artifacts): its waiters query again, and that query pulls it."""
        with self._lock:
            waiters = self._key_waiters.pop(key, [])
        for w in waiters:
            if w.ctx.ok(m.Waited(True)):
                self.counters.inc("waiters_notified_remote")

    def _park(self, ctx: CallContext, table: dict[Any, list[_Waiter]], key: Any) -> None:
        # Under self._lock: registration and the index check are atomic, so a settlement cannot slip between.
        w = _Waiter(ctx, table, key)
        table[key].append(w)
        heapq.heappush(self._deadlines, (ctx.deadline_ns, next(self._seq), w))
        self.counters.inc("waiters_parked")
        self._wake.notify()

    def _on_settled(self, ticket: SaveTicket, ok: bool) -> None:
        self._settled.append((ticket, ok))  # called by the index under self._lock; replies go out after
        self.reservations.settled(ticket.save_id)

    def _answer_settled(self) -> None:
        with self._lock:
            # A pull from Mooncake reserves (evicting) and commits on Mooncake's threads, not in a handler: its
            # events go out now, not whenever the next save's handler would have published them.
            if self.index is not None:
                self._publish_locked(self.index)
            settled, self._settled = self._settled, []
            answers: list[tuple[_Waiter, bool]] = []
            for ticket, ok in settled:
                answers += [(w, ok) for w in self._save_waiters.pop(ticket.save_id, [])]
                if ok:
                    for k in ticket.keys:
                        answers += [(w, True) for w in self._key_waiters.pop(k, [])]
        for w, ok in answers:
            if w.ctx.ok(m.Waited(ok)):
                self.counters.inc("waiters_notified")

    # ---- timer thread: waiter deadlines and the TTL reaper ----

    def _timer_main(self) -> None:
        next_reap = time.monotonic() + self.reap_interval_s
        while True:
            with self._lock:
                expired = self._pop_expired_locked()
                if time.monotonic() >= next_reap:
                    self._reap_locked()
                    next_reap = time.monotonic() + self.reap_interval_s
                if not expired and not self._settled and not self._stopping:
                    wait = next_reap - time.monotonic()
                    if self._deadlines:
                        wait = min(wait, (self._deadlines[0][0] - time.monotonic_ns()) / 1e9)
                    self._wake.wait(max(wait, 0.0))  # woken by a new waiter or shutdown: never polls
                    continue
                if self._stopping:
                    return
            for w in expired:
                if w.ctx.ok(m.Waited(False)):
                    self.counters.inc("waiters_timed_out")
            self._answer_settled()  # a reaped save settles its waiters too

    def _pop_expired_locked(self) -> list[_Waiter]:
        expired: list[_Waiter] = []
        now_ns = time.monotonic_ns()
        while self._deadlines and self._deadlines[0][0] <= now_ns:
            w = heapq.heappop(self._deadlines)[2]
            waiters = w.table.get(w.key)
            if waiters is not None and w in waiters:  # else: already answered by a settlement
                waiters.remove(w)
                if not waiters:
                    del w.table[w.key]
                expired.append(w)
        return expired

    def _reap_locked(self) -> None:
        index = self.index
        if index is None:
            return
        out = index.reap()
        self.reservations.expire()
        self.query_claims.expire()
        self.query_claims.prune(lambda lease_id: lease_id in index.leases)  # leases the TTL ended
        for what, req_ids in out.items():
            for rid in req_ids:
                # Every TTL reclaim is a missed release elsewhere: log it with the request and count it.
                log.warning("ttl_reclaimed", what=what, req_id=rid)
                self.counters.inc(f"ttl_reclaimed_{what}")

    # ---- observability and shutdown ----

    @handles(m.TierStats)
    def tier_stats(self, msg: m.TierStats, ctx: CallContext) -> m.TierCounters:
        with self._lock:
            stats = self._index().stats()
            stats["waiters"] = sum(len(v) for v in self._save_waiters.values()) + \
                sum(len(v) for v in self._key_waiters.values())
            stats["abandoned_reservations_remembered"] = self.reservations.remembered
        if self.remote is not None:
            stats.update(self.remote.stats())
        return m.TierCounters(stats)

    @handles(m.Stats)
    def stats(self, msg: m.Stats, ctx: CallContext) -> m.StatsReport:
        report = super().stats(msg, ctx)
        with self._lock:
            if self.index is not None:
                report.counters.update({f"index.{k}": v for k, v in self.index.stats().items()})
        if self.remote is not None:
            report.counters.update(self.remote.stats())
        if self.events is not None:
            report.counters.update(self.events.stats())
        return report

    def _publish_locked(self, index: HostIndex) -> None:
        """Hand the index's events since the last call to the publisher, in order (under `self._lock`)."""
        if self.events is not None:
            self.events.publish(index.take_events())

    def on_stop(self) -> None:
        if self.remote is not None:  # before the segment goes: Mooncake's engine has it registered
            self.remote.close()
        with self._lock:
            self._stopping = True
            if self.index is not None:  # let go of the segment's view, so the segment unmaps now
                self.index.detach_slot_table()
            waiters = [w for t in (self._save_waiters, self._key_waiters) for ws in t.values() for w in ws]
            self._save_waiters.clear()
            self._key_waiters.clear()
            self._deadlines.clear()
            self._wake.notify_all()
        for w in waiters:
            w.ctx.fail(HandlerError("shutting_down", "host tier is stopping"))
        if self.events is not None:
            self.events.close()
        super().on_stop()
