"""`RemoteTier` and `RemoteCopier`: the store's `Tier` / `Copier` protocols over kvproc's RPC to the host-tier and
copy-worker processes. Same semantics as `kvproc.store.local_tier` (the reference), with the process boundary's rules:

- Every call awaited on the store's loop goes through the incarnation's sync `RpcClient` and its I/O thread
  (`await_sync_call`), with the caller's timeout as the call's deadline; the reply is exactly one of Ok / Failed /
  Cancelled / PeerDead. The client's death (the launcher's supervisor, heartbeats, `Goodbye`) fails its calls at
  once. (The loop once had a socket of its own per peer, `ipc/aclient.py`; no end-to-end figure needed it:
  bench/RESULTS.md, "Control path".)
- Fire-and-forget calls (release, commit, abort, revoke) never raise: their replies are still read; a failure is
  counted and logged; a dead tier's state dies with it, a live tier's TTL reaper is the backstop.
- `RemoteTier.available` is False once the tier's peer is dead: the store then degrades to device-only caching.
- A copy order is not cancellable: it is sent with a long deadline (`copy_timeout_s`, a hung-worker bound, not a
  latency target) and no cancel token, and its future ends with the worker's real outcome or PeerDead (raised).
- The copy worker is restartable: the copier re-sends `AttachArenas` to a new incarnation before its next order.
"""

from __future__ import annotations

import asyncio
import itertools
import secrets
import threading
import time
from collections import Counter, deque
from typing import Any, Callable, Sequence

import msgspec
import numpy as np
import structlog

from kvproc.ipc import messages as m
from kvproc.ipc.client import RpcClient
from kvproc.ipc.errors import PeerDeadError, RemoteError
from kvproc.ipc.orders import LoadOrder, SaveOrder, SlotCopy
from kvproc.tiers.api import LATE_REPLY_GRACE_S
from kvproc.tiers.host_index import Hit, Loading, Miss, QueryResult, SaveClass, SaveTicket, Shed
from kvproc.tiers.layout import HostLayout
from kvproc.tiers.load_fence import SETTLE_POLL_S, LoadFences, ProcessId, process_gone

log = structlog.get_logger("kvproc.remote")

# Fire-and-forget messages sent again after a stall (idempotent at the tier).
_REPLAYED = (m.ReleaseLease, m.AbortSave, m.RevokeHandoff)
REPLAY_BACKLOG = 4096  # fire-and-forget messages kept for a reconnect (beyond: the oldest is left to the TTLs)
ClientSource = Callable[[], RpcClient]  # the current incarnation's client (e.g. lambda: cluster.client(role, rank))


async def await_sync_call(client: RpcClient, msg: m.RequestBody, timeout: float,
                on_late: Callable[[Any], None] | None = None) -> Any:
    """Await one call through the sync client's I/O thread (every call the store's loop makes); the payload, or the
    reply's typed exception (RemoteError, PeerDeadError, CallCancelled). `on_late`: where the reply goes if the
    awaiter gave up first (for answers that hold something, e.g. a Hit's lease).

    Not `asyncio.wrap_future`: cancelling its wrapper (the store cancels a wait at its deadline) cancels the client's
    concurrent future, and the client's I/O thread would then fail on `set_result` of a cancelled future. Here a
    cancelled awaiter just stops listening; the call still ends in its one terminal reply, which is dropped.
    """
    cfut = client.call(msg, timeout=max(timeout, 0.001))
    loop = asyncio.get_running_loop()
    afut: asyncio.Future[Any] = loop.create_future()

    def settle(f: Any) -> None:
        if not afut.done():
            afut.set_result(f.result())
        elif on_late is not None:  # the awaiter gave up: the answer still goes somewhere
            on_late(f.result())

    def relay(f: Any) -> None:
        try:
            loop.call_soon_threadsafe(settle, f)
        except RuntimeError:  # the store's loop is closed: nobody is waiting any more
            pass

    cfut.add_done_callback(relay)
    reply = await afut
    return reply.unwrap()


def _query_result(res: Any, epoch: int = 0) -> QueryResult:
    if isinstance(res, m.TierHit):
        return Hit(res.pages, res.lease_id, tuple(res.page_slots), dict(res.bounded_slots), tuple(res.page_gens),
                   epoch)
    if isinstance(res, m.TierLoading):
        return Loading(res.ready_pages, res.save_id)
    return Miss()


def save_events(token_ids: np.ndarray | None, parent_key: bytes | None) -> m.SaveEvents | None:
    """`ReserveSave.events`: the save's parent page and token ids (each given only where the tier's `Configured`
    asked for it), or None when there is neither."""
    if token_ids is None and parent_key is None:
        return None
    return m.SaveEvents(parent_key, token_ids.astype(np.int64, copy=False).tobytes() if token_ids is not None else None)


class RemoteTier:
    def __init__(self, client: ClientSource, layout: HostLayout, *, segment: str = "",
                 oneway_timeout_s: float = 5.0, wants_token_ids: bool = False,
                 wants_parent_key: bool = False) -> None:
        """`segment`: the tier's host segment (the direct path maps it: `store/host_direct.py`). `wants_token_ids`:
        the tier's `Configured` asked for each save's token ids (its KV events carry them). `wants_parent_key`: it
        publishes KV events (`Configured.kv_events`), so each save's parent page goes with it."""
        self._client = client
        self.layout = layout
        self.segment = segment  # the tier's host segment (a replaced tier's: `rebind`)
        self.wants_token_ids = wants_token_ids
        self.wants_parent_key = wants_parent_key
        self.oneway_timeout_s = oneway_timeout_s
        self.counters: Counter[str] = Counter()
        self._closed = False
        # Reservation ids (`ReserveSave.reservation`): a random base per store, so two stores sharing a tier never
        # name each other's reservations.
        self._reservations = itertools.count((secrets.randbits(40) << 20) + 1)
        self._backlog: deque[tuple[int, m.RequestBody]] = deque()  # (tier pid, message) lost to a dead client
        self._backlog_lock = threading.Lock()
        # Which attachment of the tier this is: 0, then +1 each time the tier is replaced (`rebind`). Its hits carry
        # it into their loads, and the copy worker refuses a load from another one (`AttachArenas.host_epoch`).
        self.epoch = 0

    def rebind(self, layout: HostLayout, segment: str, *, wants_token_ids: bool, wants_parent_key: bool) -> None:
        """The tier was replaced (another process, same endpoint): from here on this object speaks for the new one,
        with nothing of the old one kept -- the next epoch (the old one's hits load nothing: the worker refuses
        them) and no backlog of its ids (the new tier's ids start elsewhere anyway: `HostIndex`). Called before the store's client
        to the new tier is put in place, so nothing of the old epoch reaches it."""
        with self._backlog_lock:
            self.counters["oneway_replay_other_tier"] += len(self._backlog)
            self._backlog = deque()
        self.layout = layout
        self.segment = segment
        self.wants_token_ids = wants_token_ids
        self.wants_parent_key = wants_parent_key
        # Last: a thread that reads the epoch and then the segment and layout (`HostDirect.remap_if_replaced`, on a
        # copying thread) sees a new epoch only with the new tier's segment, never the old segment under the new
        # epoch (it would keep that mapping for good, and the new tier's leases would pass its epoch check).
        self.epoch += 1
        self.counters["rebinds"] += 1

    @property
    def available(self) -> bool:
        return not self._closed and self._client().alive

    # ---- awaited calls ----

    async def query(self, req_id: str, hashes: Sequence[bytes], *, timeout: float,
                    parent: bytes | None = None) -> QueryResult:
        """Awaited on the store's loop. If the awaiting resolve gives up (its deadline, its cancel token) and the answer
        still comes, a late Hit's lease is released, not left to the TTL."""
        claim = next(self._reservations)
        msg = m.Query(req_id, list(hashes), parent if self.wants_parent_key else None, claim)
        epoch = self.epoch  # the attachment the answer's slots belong to, even if the tier is replaced meanwhile
        try:
            return _query_result(await await_sync_call(self._client(), msg, timeout, on_late=self._late_answer), epoch)
        except BaseException:
            self._abandon_claim(claim)
            raise

    def _abandon_claim(self, claim: int) -> None:
        """A query whose answer this store will not use: a late answer on a live socket is released by its lease id
        (`_late_answer`), but one the tier serves after this store's client declared it dead (a stall) reaches nobody.
        So the lease is released by the query's claim, now or -- the client being dead -- once reconnected to that
        tier process; a tier that has not served the query yet refuses it if it still comes (a miss nobody reads)."""
        self.counters["query_claims_abandoned"] += 1
        self._oneway(m.ReleaseLease(0, "", claim))

    def _late_answer(self, reply: Any) -> None:
        if isinstance(reply, m.Ok) and isinstance(reply.payload, m.TierHit):
            self.counters["late_hits_released"] += 1
            self.release_lease(reply.payload.lease_id)

    async def wait_settled(self, save_id: int, *, timeout: float) -> bool:
        return await self._wait(m.WaitSettled(save_id), timeout)

    async def wait_key(self, key: bytes, *, timeout: float) -> bool:
        return await self._wait(m.WaitKey(key), timeout)

    async def _wait(self, msg: m.RequestBody, timeout: float) -> bool:
        # The tier answers at the settlement, or Waited(False) at the deadline. Any failure is False too (the store
        # re-queries, which surfaces a dead tier as a degrade); an unexpected error backs off briefly first so a
        # misbehaving tier cannot turn the resolver's loop into a busy one.
        t0 = time.monotonic()
        try:
            return bool((await await_sync_call(self._client(), msg, timeout)).ok)
        except RemoteError as e:
            if e.code != "deadline_exceeded":
                self.counters[f"wait_failed_{e.code}"] += 1
                await asyncio.sleep(max(0.0, min(0.05, timeout - (time.monotonic() - t0))))
            return False
        except Exception:  # noqa: BLE001 - PeerDead / cancelled: the next query says what happened
            return False

    async def reserve_save(self, req_id: str, keys: Sequence[bytes], bounded_groups: Sequence[str],
                           save_class: SaveClass, *, timeout: float, token_ids: np.ndarray | None = None,
                           parent_key: bytes | None = None, retain_s: float | None = None) -> SaveTicket | Shed:
        events = save_events(token_ids, parent_key if self.wants_parent_key else None)
        reservation = next(self._reservations)
        msg = m.ReserveSave(req_id, list(keys), list(bounded_groups), save_class.value, events, reservation,
                            float(retain_s) if retain_s else None)
        try:
            res = await await_sync_call(self._client(), msg, timeout)
        except BaseException:
            # No ticket, yet the tier may have opened the save, or still will (a stalled tier serves the request
            # once it runs again): abort it by its reservation, now or -- the client being dead -- once reconnected
            # to that tier process (`_defer`, `reconnected`). A tier that never saw it refuses it if it still comes.
            self.counters["reservations_abandoned"] += 1
            self._oneway(m.AbortSave(0, False, reservation))
            raise
        if isinstance(res, m.TierShed):
            return Shed(res.reason)
        return SaveTicket(res.save_id, res.req_id, SaveClass(res.save_class), tuple(res.keys), tuple(res.page_slots),
                          dict(res.bounded_slots), res.expires, res.fence, res.fence_token)

    async def stats(self) -> dict[str, int]:
        self._replay(self._client())  # also a moment to send what a stall kept back (an idle store sends nothing else)
        res = await await_sync_call(self._client(), m.TierStats(), self.oneway_timeout_s)
        return dict(res.counters)

    # ---- fire-and-forget ----

    def release_lease(self, lease_id: int, consume_handoff: str | None = None) -> None:
        self._oneway(m.ReleaseLease(lease_id, consume_handoff or ""))

    async def commit_save(self, save_id: int, *, timeout: float) -> bool:
        # Answered, not fire-and-forget: a commit the tier refuses (the save was reaped) is a failed save.
        try:
            await await_sync_call(self._client(), m.CommitSave(save_id), timeout)
        except RemoteError as e:
            if e.code == "save_reclaimed":
                self.counters["commits_refused"] += 1
                return False
            raise
        return True

    def abort_save(self, save_id: int, writer_dead: bool = False) -> None:
        self._oneway(m.AbortSave(save_id, writer_dead))

    def revoke_handoff(self, producer_req_id: str, consumed: bool = False) -> None:
        self._oneway(m.RevokeHandoff(producer_req_id, consumed))

    def _defer(self, msg: m.RequestBody, pid: int, why: Any) -> bool:
        """A release, abort or revoke lost to a dead client (the tier stalled past its heartbeats; the message may or
        may not have reached it): kept, and sent again once this store is reconnected to the same tier process
        (`_replay`), instead of leaving the lease, the save's slots and pending pages, or the hand-off pins to the
        tier's TTLs (found by `kvproc bench chaos`). Each is idempotent at the tier: a repeat finds nothing."""
        if self._closed or type(msg) not in _REPLAYED or not pid or not (
                isinstance(why, (m.PeerDead, PeerDeadError))):
            return False
        with self._backlog_lock:
            if len(self._backlog) >= REPLAY_BACKLOG:
                self.counters["oneway_replay_dropped"] += 1  # bounded: the oldest goes to the TTL, as before
                self._backlog.popleft()
            self._backlog.append((pid, msg))
        self.counters[f"oneway_deferred_{type(msg).__name__}"] += 1
        return True

    def reconnected(self) -> None:
        """The store's client to this tier was replaced by a live one (the tier answers again after a stall): send
        what the stall kept back now -- the aborts of saves it left open among them -- instead of at the next
        fire-and-forget call, which an idle store may not make for a long time."""
        self._replay(self._client())

    def _replay(self, sync: RpcClient) -> None:
        """Send what `_defer` kept, now that `sync` (the current client) is alive: only to the tier process it was
        meant for (a replaced tier never knew those ids)."""
        if not self._backlog or not sync.alive or not sync.server_pid:
            return
        with self._backlog_lock:
            todo, self._backlog = self._backlog, deque()
        for pid, msg in todo:
            if pid == sync.server_pid:
                self.counters["oneway_replayed"] += 1
                self._oneway(msg)
            else:
                self.counters["oneway_replay_other_tier"] += 1

    def _oneway(self, msg: m.RequestBody) -> None:
        what = type(msg).__name__
        pid = 0

        def done(reply: Any) -> None:  # the terminal reply (or an exception, e.g. a refused handshake)
            if not isinstance(reply, m.Ok) and not self._defer(msg, pid, reply):
                self.counters[f"oneway_failed_{what}"] += 1
                log.warning("tier_oneway_failed", request=what, reply=type(reply).__name__,
                            detail=getattr(reply, "message", getattr(reply, "reason", str(reply))))

        try:
            sync = self._client()
            pid = sync.server_pid
            self._replay(sync)
            sync.send_oneway(msg, timeout=self.oneway_timeout_s, on_reply=done)  # the reply: on the I/O thread
        except Exception as e:  # noqa: BLE001 - never raise from a fire-and-forget call
            if not self._defer(msg, pid, e):
                self.counters[f"oneway_failed_{what}"] += 1
                log.warning("tier_oneway_failed", request=what, error=repr(e))

    def close(self) -> None:
        self._closed = True


class RemoteCopier:
    """One rank's copy worker. `attach` is the worker's `AttachArenas`; it is (re)sent to each new incarnation."""

    def __init__(self, client: ClientSource, attach: m.AttachArenas, *, copy_timeout_s: float = 120.0,
                 attach_timeout_s: float = 10.0, load_fences: LoadFences | None = None) -> None:
        self._client = client
        # Each Load claims one of these words in the worker; a load is settled (its word revoked) before its caller
        # may free the blocks: a stalled worker never writes blocks given to another request
        # (`kvproc/tiers/load_fence.py`). None: unfenced (a worker attached without the fence segment).
        self.load_fences = load_fences
        self.attach_msg = attach
        self.copy_timeout_s = copy_timeout_s
        self.attach_timeout_s = attach_timeout_s
        self._attached_to: RpcClient | None = None
        self._attach_lock: asyncio.Lock | None = None  # created on the store's loop at first use
        self.attaches = 0
        self._writer_id: ProcessId | None = None  # the worker last seen serving orders (`_writer`)
        # The worker's own time for each recent Load (`Copied.ns`), newest last, and how many have completed: what
        # a load's bytes cost where they moved (`kvproc bench ipc` pairs each resolve with its load's copy time, one
        # resolving thread at a time; with several, the count is a statistic, not a per-call record).
        self.load_copy_ns: deque[int] = deque(maxlen=1024)
        self.loads_copied = 0

    def rehost(self, segment: str, layout: m.HostLayoutSpec, timeout: float) -> None:
        """The host tier was replaced: attach the worker to the new tier's segment (the old one is unmapped there
        once no copy uses it), as the next host epoch, so that a load from the old tier's slots is refused. Sent
        now, not before the next order, so the old segment is let go of at once."""
        self.attach_msg = msgspec.structs.replace(self.attach_msg, host_segment=segment, host_layout=layout,
                                                  host_epoch=self.attach_msg.host_epoch + 1)
        self._attached_to = None  # an order racing this one attaches again first: harmless
        self.attach_now(timeout)

    def attach_now(self, timeout: float) -> None:
        """Blocking first attach (before the store runs), so a bad arena or repack path fails at build time."""
        client = self._client()
        client.request(self.attach_msg, timeout=timeout)
        self._attached_to = client
        self.attaches += 1

    async def ensure_attached(self) -> RpcClient:
        client = self._client()
        if client is self._attached_to:
            return client
        if self._attach_lock is None:
            self._attach_lock = asyncio.Lock()
        async with self._attach_lock:
            client = self._client()
            if client is not self._attached_to:
                await await_sync_call(client, self.attach_msg, self.attach_timeout_s)  # PeerDeadError on a dead one
                self._attached_to = client
                self.attaches += 1
        return client

    async def _order(self, msg: m.RequestBody) -> int:
        client = await self.ensure_attached()
        res = await await_sync_call(client, msg, self.copy_timeout_s)
        if type(msg) is m.Load:
            self._loaded(res)
        return int(res.nbytes)

    def _loaded(self, res: m.Copied) -> None:
        self.load_copy_ns.append(res.ns)
        self.loads_copied += 1

    async def save(self, order: SaveOrder) -> int:
        pid = ProcessId(0)
        try:
            client = await self.ensure_attached()
            pid = self._writer(client.server_pid)
            return int((await await_sync_call(client, m.Save(order), self.copy_timeout_s)).nbytes)
        except Exception as e:
            # The worker that had the order is gone (killed, maybe in the middle of the write): say so, so the tier
            # takes back the fence claim it left instead of quarantining the slots for good. A worker that is only
            # stalled is alive: its claim is a write in progress, and the tier waits for it.
            e.writer_dead = process_gone(pid)  # type: ignore[attr-defined]
            raise

    def _word(self) -> tuple[int, int] | None:
        if self.load_fences is None:
            return None
        word = self.load_fences.issue()
        if word is None:  # every word held (by loads in flight or writes a stalled worker holds): fail, never unfenced
            raise RemoteError("load_fences_exhausted", "RuntimeError", "no free load fence word")
        return word

    def _fence(self, order: LoadOrder) -> tuple[LoadOrder, tuple[int, int] | None]:
        word = self._word()
        if word is None:
            return order, None
        return msgspec.structs.replace(order, fence=word[0], fence_token=word[1]), word

    async def _settle(self, word: tuple[int, int] | None, writer_pid: ProcessId) -> None:
        """Before the caller may free the load's blocks: the worker can no longer write them (waits while it is in the
        middle of the write, on the store's loop without blocking it)."""
        if self._settled_at_once(word, writer_pid):
            return
        assert word is not None and self.load_fences is not None
        while not self.load_fences.try_settle(word[0], word[1], writer_pid):
            await asyncio.sleep(SETTLE_POLL_S)

    def _settled_at_once(self, word: tuple[int, int] | None, writer_pid: ProcessId) -> bool:
        """No fence, or settled at the first try; else counted and logged (the caller then waits it out)."""
        if word is None or self.load_fences is None or self.load_fences.try_settle(word[0], word[1], writer_pid):
            return True
        self.load_fences.waited += 1
        log.warning("load_fence_wait", fence=word[0], worker_pid=writer_pid.pid)
        return False

    async def load(self, order: LoadOrder) -> int:
        fenced, word = self._fence(order)
        pid = ProcessId(0)
        try:
            client = await self.ensure_attached()
            pid = self._writer(client.server_pid)
            res = await await_sync_call(client, m.Load(fenced), self.copy_timeout_s)
        finally:
            await self._settle(word, pid)
        self._loaded(res)
        return int(res.nbytes)

    async def device_copy(self, copies: Sequence[SlotCopy], after_event: bytes | None = None) -> int:
        """Fenced like a load: the destination slots are written by this order only until the store settles it."""
        word = self._word()
        msg = m.DeviceCopy(list(copies), *(word if word is not None else (-1, 0)), after_event)
        pid = ProcessId(0)
        try:
            client = await self.ensure_attached()
            pid = self._writer(client.server_pid)
            res = await await_sync_call(client, msg, self.copy_timeout_s)
        finally:
            await self._settle(word, pid)
        return int(res.nbytes)

    def _writer(self, pid: int) -> ProcessId:
        """The copy worker serving this copier's orders, known by pid and start time (read the first time that pid
        answers: later, once it is dead, the pid may name another process)."""
        w = self._writer_id
        if w is None or w.pid != pid:
            w = self._writer_id = ProcessId.of(pid)
        return w

    def close(self) -> None:
        self._attached_to = None
