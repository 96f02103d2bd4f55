"""`KvStore`: the scheduler process's one KV object, with per-rank pools, a tier and copy workers, frozen after build.

The three verbs (reference design section 4):
- `resolve_prefix`: probe the device pool, ask the tier for the rest under one deadline, reserve opportunistically,
  load, commit into the index, return the held prefix. Degradation only shortens the prefix (reason in stats).
- `seal`: save pages sealed since the cursor (pinned until the copy lands) and the bounded checkpoint at the
  boundary, asynchronously; Cacheable saves are shed under pin pressure, Handoff saves are leased by the tier.
- `retire`: final seal, then release; with Handoff saves pending the request parks until they settle.

Threading: verbs may be called from any thread. Async work runs on the store's own event loop thread
(`LoopThread`); the pools are lock-protected. Every async operation ends in one recorded `Outcome`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import time
from collections import Counter
from typing import Any, Sequence

import numpy as np
import structlog

from kvproc.contract import REPLICATED_SAVER_RANK, ArenaLayout
from kvproc.core.eviction import DEVICE_DEFAULT
from kvproc.core.hashing import DEFAULT_SCOPE, HashScope
from kvproc.core.holds import ReusePolicy
from kvproc.core.ownership import ForeignHandleError, next_pool_serial, require_type
from kvproc.core.pool import BlockPool
from kvproc.core.request_kv import RequestKv, RequestStateError
from kvproc.ipc.cancel import CancelToken
from kvproc.ipc.errors import reason_of
from kvproc.ipc.orders import BoundedCopy, SaveOrder, SlotCopy
from kvproc.runtime.histogram import Histogram, is_histogram_key
from kvproc.runtime.loopthread import LoopThread
from kvproc.store.resolve import Resolver
from kvproc.store.types import (
    HandoffUnavailable,
    InvalidSealCursor,
    KvPrefix,
    Outcomes,
    ResolvePolicy,
    SaveClass,
    SealCursor,
    StepFence,
    StoreConfig,
    check_retain_s,
)
from kvproc.tiers.api import Copier, Tier
from kvproc.tiers.host_index import SaveTicket, Shed

log = structlog.get_logger("kvproc.store.kv_store")


class KvStore:
    def __init__(
        self,
        layouts: Sequence[ArenaLayout],
        *,
        live_slots: int,
        tier: Tier | None = None,
        copiers: Sequence[Copier] | None = None,
        config: StoreConfig = StoreConfig(),
        pools: Sequence[BlockPool] | None = None,
        tiers: Sequence[Tier] | None = None,
        step_fence: StepFence | None = None,
    ) -> None:
        """`tier`: the host tier of a one-rank store, or the one tier of a REPLICATED model's ranks; `tiers`: one per
        rank (a tier's index has no rank in its keys, so the ranks of a PER_RANK model never share one: each rank's
        shard lives in its own tier).

        `step_fence`: how an engine whose steps run asynchronously on a GPU orders kvproc's copies after them:
        `step_fence(rank)` returns the CUDA IPC handle (`torch.cuda.Event(interprocess=True).ipc_handle()`) of the
        event it recorded after its latest step on that rank's device, or None. The store calls it once per `seal`
        that issues a save (and `retire`'s final seal) and once per `execute_copies`, on the calling (engine) thread,
        and puts the handle into those orders (`SaveOrder.after_event`, `DeviceCopy.after_event`): the copy worker's
        stream waits on that event on the GPU before it reads the pages. None (the default): no call, no handle.

        A REPLICATED model (`KvSpec.replicated`: every rank holds the same KV) is stored once: its ranks share one
        tier, rank `REPLICATED_SAVER_RANK` saves into it, every rank's resolve loads from it."""
        if tier is not None and tiers is not None:
            raise ValueError("pass tier= (one rank) or tiers= (one per rank), not both")
        spec = layouts[0].spec
        spec.check_sharding(len(layouts))
        self.replicated = spec.replicated and len(layouts) > 1
        if tiers is None:
            if tier is not None and len(layouts) > 1 and not self.replicated:
                raise ValueError(f"a store of {len(layouts)} ranks needs one tier per rank (tiers=[...]): ranks "
                                 "sharing one tier would be served each other's shards")
            tiers = [tier] * len(layouts) if tier is not None else []
        elif len(tiers) != len(layouts):
            raise ValueError(f"{len(tiers)} tiers for {len(layouts)} ranks: one tier per rank")
        if tiers and len({id(t) for t in tiers}) != (1 if self.replicated else len(tiers)):
            raise ValueError("a REPLICATED model's ranks share one tier (it is stored once): pass tier=" if
                             self.replicated else "ranks of a PER_RANK model never share a tier (a tier's keys carry "
                             "no rank: they would be served each other's shards)")
        if tiers and (copiers is None or len(copiers) != len(layouts)):
            raise ValueError("a store with a tier needs one copier per rank")
        self.config = config
        self.step_fence = step_fence
        self.layouts = tuple(layouts)
        self.pools = tuple(pools) if pools is not None else tuple(
            BlockPool.from_layout(lay, live_slots=live_slots, rank=r, eviction=config.eviction or DEVICE_DEFAULT)
            for r, lay in enumerate(layouts)
        )
        self.spec = self.layouts[0].spec
        # Errors name a foreign handle's owner by store and rank: two stores in one process each have a rank 0.
        self.serial = next_pool_serial()
        for r, p in enumerate(self.pools):
            p.label = f"store #{self.serial} rank {r} (pool #{p.serial})"
        self.tiers: tuple[Tier, ...] = tuple(tiers)
        self.copiers = tuple(copiers or ())
        self.outcomes = Outcomes(config.outcome_history)
        self.counters: Counter[str] = Counter()
        self._count_lock = threading.Lock()
        # Resolve latency as the caller sees it (verb called -> prefix ready), by what served it: `hit` = host (some
        # pages restored from the tier), device (the device pool only), miss (nothing, degraded included).
        self._resolve_latency = {k: Histogram("resolve_latency_seconds", k) for k in ("host", "device", "miss")}
        self._loop = LoopThread()
        self._saves: list[set[asyncio.Task[None]]] = [set() for _ in self.layouts]
        # Loads a resolve stopped waiting for, until they settle.
        self._loads: list[set[Any]] = [set() for _ in self.layouts]
        self._parked: list[dict[str, RequestKv]] = [{} for _ in self.layouts]
        self._cacheable_pinned = [0] * len(self.layouts)
        self._acct = threading.Lock()  # cacheable pin budget and seal cursors: touched by engine threads and the loop
        self._resolver = Resolver(self)
        self._closed = False

    @property
    def tier(self) -> Tier | None:
        """Rank 0's tier (a one-rank store's only one); `tiers[rank]` for the others."""
        return self.tiers[0] if self.tiers else None

    def tier_of(self, rank: int) -> Tier | None:
        return self.tiers[rank] if self.tiers else None

    @property
    def distinct_tiers(self) -> list[tuple[int, Tier]]:
        """(first rank using it, tier) for each tier once (a REPLICATED model's ranks share one)."""
        first: dict[int, tuple[int, Tier]] = {}
        for r, t in enumerate(self.tiers):
            first.setdefault(id(t), (r, t))
        return list(first.values())

    @staticmethod
    def _check_resolve_args(scope: HashScope, policy: ResolvePolicy, cancel: CancelToken | None) -> None:
        """A plain string for a scope (a tenant name) or a dict for a policy would hash or behave as the default:
        another tenant's prefix served, or a hand-off's lease never consumed. Refused by type."""
        require_type(scope, HashScope, "scope")
        require_type(policy, ResolvePolicy, "policy")
        if cancel is not None:
            require_type(cancel, CancelToken, "cancel")

    def _check_rank(self, rank: int) -> None:
        """Refuse a rank this store does not have (a negative one too: it must not silently mean the last rank)."""
        n = len(self.pools)
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < n:
            raise ValueError(f"rank {rank!r} is outside this store's ranks [0, {n})"
                             + (" (a one-rank store has rank 0 only)" if n == 1 else ""))

    def submit(self, coro: Any) -> concurrent.futures.Future[Any]:
        """Run a coroutine on the store's loop (the tier's calls live there); a future for its result."""
        return self._loop.submit(coro)

    def call(self, fn: Any, *args: Any) -> None:
        """Call `fn(*args)` on the store's loop, not waiting (the tier's fire-and-forget calls)."""
        self._loop.call(fn, *args)

    def count(self, name: str, n: int = 1) -> None:
        """Bump a store counter (engine threads, resolving threads and the loop all count)."""
        with self._count_lock:
            self.counters[name] += n

    def count_many(self, *pairs: tuple[str, int]) -> None:
        """Several counters under one acquisition of the lock (a resolve bumps two)."""
        with self._count_lock:
            for name, n in pairs:
                self.counters[name] += n

    # -- resolve --------------------------------------------------------------------------------------------------
    async def resolve_prefix(
        self,
        rank: int,
        req_id: str,
        tokens: Sequence[int] | np.ndarray,
        scope: HashScope = DEFAULT_SCOPE,
        policy: ResolvePolicy = ResolvePolicy(),
        cancel: CancelToken | None = None,
    ) -> KvPrefix:
        """Awaitable from any event loop (the work runs on the store's loop).

        `tokens` is the prompt, read and not copied: the engine does not change it in place afterwards (a list or
        array it owns for the request; appending output after it is fine). The device pool's KV events read the
        restored pages' token ids from it on their publisher's thread, up to one batch interval later."""
        self._check_rank(rank)
        return await asyncio.wrap_future(self.submit_resolve(rank, req_id, tokens, scope, policy, cancel))

    def submit_resolve(
        self,
        rank: int,
        req_id: str,
        tokens: Sequence[int] | np.ndarray,
        scope: HashScope = DEFAULT_SCOPE,
        policy: ResolvePolicy = ResolvePolicy(),
        cancel: CancelToken | None = None,
    ) -> concurrent.futures.Future[KvPrefix]:
        """Thread form of `resolve_prefix` (its `tokens` rule too): a future with the `KvPrefix` (never an exception
        for a degrade). The resolve runs on the store's loop."""
        self._check_rank(rank)
        self._check_resolve_args(scope, policy, cancel)
        t0 = time.perf_counter_ns()
        fut = self._loop.submit(self._resolver.resolve(rank, req_id, tokens, scope, policy, cancel))
        fut.add_done_callback(functools.partial(self._observe_resolve_future, t0))
        return fut

    def resolve_prefix_sync(self, rank: int, req_id: str, tokens: Sequence[int] | np.ndarray,
                            scope: HashScope = DEFAULT_SCOPE, policy: ResolvePolicy = ResolvePolicy(),
                            cancel: CancelToken | None = None) -> KvPrefix:
        """Blocking `resolve_prefix`, same result and rules (it waits for `submit_resolve`'s future). Not from the
        store's own loop: it would wait for itself (refused, RuntimeError)."""
        if self._loop.on_loop:
            raise RuntimeError("resolve_prefix_sync on the store's own loop would wait for itself: await "
                               "resolve_prefix there")
        return self.submit_resolve(rank, req_id, tokens, scope, policy, cancel).result()

    def _observe_resolve(self, t0_ns: int, prefix: KvPrefix) -> None:
        kind = "host" if prefix.host_tokens else "device" if prefix.device_tokens else "miss"
        self.count_many(*self._resolve_latency[kind].keys(time.perf_counter_ns() - t0_ns))

    def _observe_resolve_future(self, t0_ns: int, fut: concurrent.futures.Future[KvPrefix]) -> None:
        if not fut.cancelled() and fut.exception() is None:  # a bug or a cancelled future: no latency to speak of
            self._observe_resolve(t0_ns, fut.result())

    # -- seal -----------------------------------------------------------------------------------------------------
    def seal(self, rank: int, kv: RequestKv, cursor: SealCursor, save_class: SaveClass = SaveClass.CACHEABLE, *,
             retain_s: float | None = None) -> None:
        """Save the pages sealed since `cursor` (and the bounded checkpoint at the last one). Non-blocking: the save
        runs on the store's loop; its source pages stay pinned until the copy lands. Call only after the step that
        wrote them synchronized (i.e. after `kv.apply`).

        `retain_s` (seconds; None: no hint, today's behaviour): the serving layer's retention hint, "this request's
        conversation comes back within about `retain_s`" (a chat session still open, an agent loop mid-task). The save
        then covers the request's pages from its first (those the tier holds already are deduplicated: held and
        re-ranked, not copied; those it lost are saved again), and the tier's eviction policy ranks all of them as if
        used `retain_s` later (bounded by the tier's `max_retain_s`). A priority, never a pin. Cacheable saves only:
        give it once, at the request's end (`retire`), as each hinted seal sends the whole prompt's keys."""
        self._check_rank(rank)
        require_type(save_class, SaveClass, "save_class")
        require_type(cursor, SealCursor, "cursor")
        retain = check_retain_s(retain_s, save_class)
        self._check_owner(self.pools[rank], kv, cursor)
        tier = self.tier_of(rank)
        if tier is None or not self.spec.prefix_caching:
            if save_class is SaveClass.HANDOFF:
                self.count("handoff_refused")
                raise HandoffUnavailable(kv.req_id, self.handoff_unavailable_reason(rank) or "")
            return
        pool = self.pools[rank]
        P = pool.page_tokens
        end = kv.num_computed // P
        start = cursor.pages
        # What the save covers: the pages since the cursor, or with a retention hint every page of the request.
        lo = 0 if retain else start
        self._check_seal(pool, kv, cursor, end, lo)
        if end <= lo:
            return
        if self.replicated and rank != REPLICATED_SAVER_RANK:
            # Stored once: the saver rank's copy is every rank's (same KV). Nothing to wait for on this rank.
            self.count("seal_replicated_by_saver")
            return
        required = [g.name for g in self.spec.restorable_bounded_groups if not g.optional]
        if required:
            # Pages past the last complete bounded checkpoint are useless on their own (one index at checkpoint
            # granularity): save only up to the deepest boundary where every required group has a sealed copy.
            end = self._deepest_checkpoint(pool, kv.page_hashes, lo, end, required)
            if end <= lo:
                return
        keys = kv.page_hashes[lo:end]
        ids = kv.block_ids[lo:end]
        # The pages' tokens, for a tier whose KV events carry them (`kv_events_tokens`): a view (sealed pages' tokens
        # never change), turned into bytes on the loop as the ReserveSave is built. Off: not even sliced.
        tokens = kv.token_array()[lo * P:end * P] if tier.wants_token_ids else None
        # The prompt's page before the save's first, for a tier that publishes KV events: the parent of the save's
        # first run of new pages (a save after a prefix hit starts mid-prompt, and the tier sees no chain before it).
        parent = kv.page_hashes[lo - 1] if lo and tier.wants_parent_key else None
        with pool.lock:
            # Each key must name the page its block holds (sealed in place under that hash): a key committed
            # over other bytes would serve them to every later reader of that prompt.
            named = pool.paged.block_hash.of(ids)  # one gather from the per-block key array
            if named != keys:
                self.count("seal_refused_mismatch")
                raise RequestStateError(f"request {kv.req_id!r}: pages {lo}..{end} of its block table are not "
                                        "sealed under its page hashes (released, or blocks taken over): not saved")
            staging = {g.name: s for g in self.spec.restorable_bounded_groups
                       if (s := pool.checkpoints.get(keys[-1], g.name)) is not None}
        # Read now, on the engine's thread right after the step that wrote these pages (not when the order is built on
        # the loop, steps later), and before anything is pinned or counted: a fence that raises leaves nothing behind.
        event = self._step_event(rank)
        with self._acct:
            if save_class is SaveClass.CACHEABLE:
                budget = int(pool.paged.num_blocks * self.config.cacheable_pin_fraction)
                pinned = self._cacheable_pinned[rank]
                # A save larger than the whole budget still goes when nothing else is pinned, or it never would.
                if pinned and pinned + len(ids) > budget:
                    self.count("save_shed_pin_pressure")
                    self.outcomes.record("save", kv.req_id, "shed", "pin_pressure")
                    return  # the cursor does not advance: a later seal retries
                self._cacheable_pinned[rank] += len(ids)
            cursor.pages = max(start, end)  # a hinted save of pages already handed over does not move it back
            cursor.pending += 1
            cursor.settled.clear()
        try:
            pin = pool.pin(ids, kv.block_generations()[lo:end], staging)
        except Exception:
            self._settle_accounting(rank, len(ids), save_class, cursor, start, shed=True)
            raise
        self._loop.call(self._start_save, rank, kv.req_id, keys, ids, staging, pin, save_class, cursor, start, tokens,
                        parent, event, retain)

    def _step_event(self, rank: int) -> bytes | None:
        """The engine's step fence for `rank` (None without one): a CUDA IPC event handle, as bytes."""
        if self.step_fence is None:
            return None
        event = self.step_fence(rank)
        if event is not None and not isinstance(event, bytes):
            raise TypeError(f"step_fence({rank}) returned a {type(event).__name__}: it must return the event's CUDA "
                            "IPC handle as bytes (torch.cuda.Event.ipc_handle()) or None")
        return event

    def drop_device_cache(self, rank: int, timeout: float | None = 60.0) -> int:
        """Evict rank `rank`'s device prefix cache (what nobody holds): the next resolve of those prompts goes to the
        host tier. It first waits (up to `timeout`) for the rank's saves in flight (`flush_saves`): a save pins the
        blocks it reads, which would otherwise survive the drop. Returns the blocks and staging slots freed
        (`BlockPool.evict_cached`)."""
        self._check_rank(rank)
        self.flush_saves(rank, timeout)
        return self.pools[rank].evict_cached()

    def handoff_unavailable_reason(self, rank: int = 0) -> str | None:
        """Why this store cannot deliver a hand-off from `rank` (None: it can). A producer checks before it prefills
        a hand-off request, and fails the request with this reason instead of computing KV nobody can receive."""
        if not self.spec.prefix_caching:
            return f"prefix caching is off for this model: {self.spec.prefix_caching_off_reason}"
        if self.tier_of(rank) is None:
            return f"rank {rank} has no host tier to hand the KV over through"
        return None

    def _check_owner(self, pool: BlockPool, kv: RequestKv, cursor: SealCursor) -> None:
        """The request must be this rank's (its blocks are in this pool), and the cursor this request's: a cursor
        belongs to the first request sealed with it, because its page count and pending saves are that request's
        (another's cursor would skip pages, or save pages twice, or park on saves it does not have)."""
        require_type(kv, RequestKv, "kv")
        if kv.pool is not pool:
            raise ForeignHandleError(f"request {kv.req_id!r}", kv.pool.label, pool.label)
        with self._acct:
            owner = cursor.owner
            if owner is None:
                cursor.owner = kv.identity
            elif owner is not kv.identity:
                raise ForeignHandleError("this seal cursor", "another request (the first one sealed with it)",
                                         f"request {kv.req_id!r} of {pool.label}")

    def _check_seal(self, pool: BlockPool, kv: RequestKv, cursor: SealCursor, end: int, lo: int) -> None:
        """Refuse a seal that would commit keys without their bytes (or skip pages): a cursor that is not a page
        count of this request, a released request with pages left to save. `lo`: the first page the save covers
        (the cursor's, or 0 for a hinted one)."""
        pages = cursor.pages
        # A hand-off consumer's cursor may sit one page past its computed pages (the padded page it adopted).
        if isinstance(pages, bool) or not isinstance(pages, int) or not 0 <= pages <= kv.lifetime_blocks:
            self.count("seal_refused_cursor")
            raise InvalidSealCursor(f"request {kv.req_id!r}: SealCursor.pages={pages!r} is not a page count of this "
                                    f"request (0..{kv.lifetime_blocks})")
        if end <= min(pages, lo):
            return  # nothing to save (a retire of a request that never ran gets here too)
        if kv.released or not kv.admitted:
            self.count("seal_refused_state")
            raise RequestStateError(f"request {kv.req_id!r}: seal/retire of a "
                                    f"{'released' if kv.released else 'not admitted'} request with pages to save: its "
                                    "blocks may hold other KV now (seal before release)")
        if end > len(kv.block_ids) or end > len(kv.page_hashes):
            raise RequestStateError(f"request {kv.req_id!r}: {end} computed pages but {len(kv.block_ids)} blocks and "
                                    f"{len(kv.page_hashes)} page hashes")

    @staticmethod
    def _deepest_checkpoint(pool: BlockPool, hashes: list[bytes], start: int, end: int, required: list[str]) -> int:
        with pool.lock:
            for e in range(end, start, -1):
                if all(pool.checkpoints.get(hashes[e - 1], g) is not None for g in required):
                    return e
        return start

    def _start_save(self, rank: int, req_id: str, keys: list[bytes], ids: list[int], staging: dict[str, int],
                    pin: Any, save_class: SaveClass, cursor: SealCursor, start: int,
                    tokens: np.ndarray | None = None, parent: bytes | None = None, event: bytes | None = None,
                    retain_s: float | None = None) -> None:
        task = asyncio.get_running_loop().create_task(
            self._save(rank, req_id, keys, ids, staging, pin, save_class, cursor, start, tokens, parent, event,
                       retain_s))
        self._saves[rank].add(task)
        task.add_done_callback(self._saves[rank].discard)

    async def _save(self, rank: int, req_id: str, keys: list[bytes], ids: list[int], staging: dict[str, int],
                    pin: Any, save_class: SaveClass, cursor: SealCursor, start: int,
                    tokens: np.ndarray | None = None, parent: bytes | None = None, event: bytes | None = None,
                    retain_s: float | None = None) -> None:
        state, reason = "failed", "unknown"
        ticket: SaveTicket | Shed | None = None
        tier = self.tier_of(rank)
        unpinned = False

        def unpin() -> None:  # the pin and its share of the pin budget, once the bytes need not stay put
            nonlocal unpinned
            if not unpinned:
                unpinned = True
                pin.release()
                if save_class is SaveClass.CACHEABLE:
                    with self._acct:
                        self._cacheable_pinned[rank] -= len(ids)

        try:
            assert tier is not None
            if not tier.available:
                state, reason = "shed", "tier_unavailable"
                return
            # The hint goes only when given: a tier client that predates it is called exactly as before.
            hint: dict[str, float] = {} if retain_s is None else {"retain_s": retain_s}
            ticket = await tier.reserve_save(req_id, keys, sorted(staging), save_class,
                                             timeout=self.config.tier_call_timeout_s, token_ids=tokens,
                                             parent_key=parent, **hint)
            if isinstance(ticket, Shed):
                state, reason = "shed", "tier_full"
                return
            pairs = [(b, s) for b, s in zip(ids, ticket.page_slots) if s is not None]
            bounded = [BoundedCopy(g, staging[g], s) for g, s in ticket.bounded_slots.items() if s is not None]
            if pairs or bounded:
                order = SaveOrder(req_id, [b for b, _ in pairs], [s for _, s in pairs], bounded, ticket.fence,
                                  ticket.fence_token, event)
                await self.copiers[rank].save(order)
            unpin()  # the bytes are copied: the source blocks need not wait for the commit's answer
            if await tier.commit_save(ticket.save_id, timeout=self.config.tier_call_timeout_s):
                state, reason = "ok", ""
            else:  # the tier gave the slots back first (TTL, abort): nothing of it is visible
                reason = "commit_refused"
                ticket = None  # nothing left to abort
        except Exception as e:  # noqa: BLE001 - every failure becomes a recorded outcome
            reason = reason_of(e)
            if isinstance(ticket, SaveTicket) and tier is not None:
                tier.abort_save(ticket.save_id, getattr(e, "writer_dead", False))
        finally:
            unpin()
            if reason in ("event_unsupported", "bad_event"):  # the engine's fence and the attach disagree: loud
                log.error("save refused: its engine event cannot be waited on", req_id=req_id, reason=reason)
            if state != "ok" and save_class is SaveClass.HANDOFF:  # undelivered: the consumer will see a short hit
                self.count("handoff_save_failed")
                log.error("handoff save failed", req_id=req_id, reason=reason, pages=len(keys))
            self.count(f"save_{state}")
            self.outcomes.record("save", req_id, state, reason)
            if self._settle_accounting(rank, 0, save_class, cursor, start, shed=state == "shed"):
                self._unpark(rank, req_id)

    def _settle_accounting(self, rank: int, n: int, save_class: SaveClass, cursor: SealCursor, start: int, *,
                           shed: bool) -> bool:
        """A save ended: give back `n` blocks of pin budget (what it did not give back when it unpinned), rewind a
        shed save's cursor; True when the request has no save left in flight. Under `_acct`: seals (engine threads) and settlements (the loop) race on these counts."""
        with self._acct:
            if save_class is SaveClass.CACHEABLE:
                self._cacheable_pinned[rank] -= n
            if shed and cursor.pages > start:
                cursor.pages = start  # a later seal retries
            cursor.pending -= 1
            if cursor.pending:
                return False
            cursor.settled.set()
            return True

    # -- retire ---------------------------------------------------------------------------------------------------
    def retire(self, rank: int, kv: RequestKv, cursor: SealCursor, save_class: SaveClass = SaveClass.CACHEABLE, *,
               retain_s: float | None = None) -> None:
        """Final seal, then release. Never blocks: with Handoff saves pending, the KV parks until they settle.
        `retain_s`: the request's retention hint (`seal`): the natural place to give it, the request being done and
        its conversation expected back."""
        self._check_rank(rank)
        require_type(save_class, SaveClass, "save_class")
        self.seal(rank, kv, cursor, save_class, retain_s=retain_s)
        if save_class is SaveClass.HANDOFF and cursor.pending:
            self._parked[rank][kv.req_id] = kv
            self.count("retire_parked")
            self._loop.call(self._unpark_if_settled, rank, kv.req_id, cursor)
            return
        kv.release()
        self.outcomes.record("retire", kv.req_id, "ok")

    def _unpark_if_settled(self, rank: int, req_id: str, cursor: SealCursor) -> None:
        if cursor.pending == 0:
            self._unpark(rank, req_id)

    def _unpark(self, rank: int, req_id: str) -> None:
        kv = self._parked[rank].pop(req_id, None)
        if kv is not None:
            kv.release()
            self.outcomes.record("retire", req_id, "ok", "after_handoff_saves")

    def parked(self, rank: int) -> list[str]:
        self._check_rank(rank)
        return list(self._parked[rank])

    # -- hand-off leases -------------------------------------------------------------------------------------------
    def release_handoff(self, producer_req_id: str) -> None:
        """The consumer has the hand-off's KV without a load (a device hit): release the producer's entries."""
        self._revoke_everywhere(producer_req_id, "handoff_released_at_admission", consumed=True)

    def revoke_handoff(self, producer_req_id: str) -> None:
        """Nobody will read this hand-off (the request was cancelled or rejected): release it now, not at TTL."""
        self._revoke_everywhere(producer_req_id, "handoff_revoked")

    def _revoke_everywhere(self, producer_req_id: str, counter: str, consumed: bool = False) -> None:
        # Every rank's shard of the hand-off, a tier that is down included: a remote tier keeps a revoke its dead
        # client could not send and sends it once reconnected to that tier process (`RemoteTier._defer`). Skipping
        # it left a stalled tier's hand-off pinned until the hand-off TTL (found by test_vllm_proxy_stall.py).
        tiers = [t for _, t in self.distinct_tiers]
        if tiers:
            self.count(counter)
        for t in tiers:
            self._loop.call(t.revoke_handoff, producer_req_id, consumed)

    # -- bounded copies through the worker ------------------------------------------------------------------------
    def execute_copies(self, rank: int, orders: Sequence[Any]) -> bool:
        """Run bounded SEAL/RESTORE copy orders on the rank's copy worker and fence them (blocking: the engine
        calls this between steps, and the next step must not write the live slots before it returns). Returns False
        when the copies failed (every order fenced as failed: a failed RESTORE leaves its request unschedulable,
        to be recomputed from scratch by the engine), True otherwise."""
        self._check_rank(rank)
        if not orders:
            return True
        pool = self.pools[rank]
        for o in orders:  # all refused before any runs: an order of another rank would copy that rank's slots here
            pool.check_order(o)
        if rank >= len(self.copiers):
            raise RuntimeError(f"rank {rank} has no copier: build the store with one (bounded groups need slot copies "
                               "even without a tier)")
        copies = [SlotCopy(o.group, o.src_slot, o.dst_slot) for o in orders]
        # a seal-by-copy reads live state the engine's last step wrote; a restore writes live slots its steps used
        fut = self._loop.submit(self.copiers[rank].device_copy(copies, self._step_event(rank)))
        ok = True
        try:
            fut.result()
        except Exception as e:  # noqa: BLE001
            ok = False
            log.error("bounded copy failed", rank=rank, error=repr(e))
        for o in orders:
            pool.fence(o, ok)
        return ok

    # -- flush / observe ------------------------------------------------------------------------------------------
    def flush_saves(self, rank: int, timeout: float | None = None) -> None:
        """Block until every save of `rank` started so far has settled."""
        self._check_rank(rank)

        async def _wait() -> None:
            while self._saves[rank]:
                await asyncio.gather(*list(self._saves[rank]), return_exceptions=True)
        self._loop.submit(_wait()).result(timeout)

    def flush_loads(self, rank: int, timeout: float | None = None) -> None:
        """Block until loads abandoned by a resolve deadline have settled (their reservations freed)."""
        self._check_rank(rank)

        async def _wait() -> None:
            while self._loads[rank]:
                await asyncio.gather(*map(asyncio.wrap_future, list(self._loads[rank])), return_exceptions=True)
        self._loop.submit(_wait()).result(timeout)

    def pinned_blocks(self, rank: int) -> int:
        self._check_rank(rank)
        return self.pools[rank].pinned_blocks()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"store": dict(self.counters), "outcomes": dict(self.outcomes.counts)}
        for r, pool in enumerate(self.pools):
            out[f"rank{r}"] = pool.stats() | {"parked": len(self._parked[r]),
                                              "saves_in_flight": len(self._saves[r]),
                                              "loads_abandoned_in_flight": len(self._loads[r]),
                                              "cacheable_pinned": self._cacheable_pinned[r]}
        out["tier_available"] = bool(self.tier is not None and self.tier.available)
        # "tier" is rank 0's (a one-rank store's), "tier1".. the others' (one key per tier: a REPLICATED model's
        # ranks share rank 0's)
        for r, tier in self.distinct_tiers:
            if tier.available:
                key = "tier" if r == 0 else f"tier{r}"
                try:
                    out[key] = self._loop.submit(tier.stats()).result(self.config.tier_call_timeout_s)
                except Exception as e:  # noqa: BLE001
                    out[key] = {"error": repr(e)}
        return out

    def counters_flat(self) -> dict[str, int]:
        """The store's counters, its outcomes and every pool's stats as one flat {name: int} (for the console; no
        call to the tier, unlike `stats()`)."""
        # histograms keep their own names (`runtime/histogram.py`: the exporter finds them by them)
        out = {k if is_histogram_key(k) else f"store.{k}": int(v) for k, v in list(self.counters.items())}
        out.update({f"outcome.{k}": int(v) for k, v in list(self.outcomes.counts.items())})
        for r, pool in enumerate(self.pools):
            out.update({f"rank{r}.{k}": int(v) for k, v in pool.stats().items()})
            out[f"rank{r}.parked"] = len(self._parked[r])
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        deadline = time.monotonic() + 10
        for r in range(len(self.pools)):
            try:
                self.flush_saves(r, max(0.1, deadline - time.monotonic()))
                self.flush_loads(r, max(0.1, deadline - time.monotonic()))
            except Exception:  # noqa: BLE001
                pass
            for kv in list(self._parked[r].values()):
                kv.release()
            self._parked[r].clear()
        self._loop.stop()

    def __enter__(self) -> "KvStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["KvPrefix", "KvStore", "ResolvePolicy", "ReusePolicy", "SaveClass", "SealCursor", "StoreConfig"]
