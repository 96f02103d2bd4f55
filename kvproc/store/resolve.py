"""The read path of `KvStore.resolve_prefix`, as one coroutine on the store's loop (reference design section 4).

Steps: cancelled already -> empty prefix; probe the device pool (the hold pins the match); ask the tier for the rest
under one deadline (Miss / Loading -> wait for the tier's notification / Hit); reserve destination blocks only above
the admission floor, else release the lease and wait on the pool's capacity waiter (only a resolve that holds no
device blocks waits; one that holds some goes on with its device hit: `pool_pressure`); load (not cancellable: its
reservation travels with it until it settles, even past the deadline); commit into the index; return the hold.
The lease is released on every path that does not consume it.

One form only: the store once also resolved on threads of its own (a blocking resolver) and loaded pages before the
tier's answer from a cache of slot hints, checked against the tier's slot table. Each saved a round trip or a loop hop
in a micro-benchmark; the end-to-end demo was as fast without them (bench/RESULTS.md, "Control path"), so they went.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Awaitable, Sequence

import numpy as np

from kvproc.core.hashing import HashScope
from kvproc.core.holds import ReusePolicy
from kvproc.ipc.cancel import CancelToken
from kvproc.ipc.errors import reason_of
from kvproc.ipc.orders import BoundedCopy, LoadOrder
from kvproc.store.types import KvPrefix, ResolvePolicy
from kvproc.tiers.api import LATE_REPLY_GRACE_S
from kvproc.tiers.host_index import Hit, Loading, Miss

if TYPE_CHECKING:
    from kvproc.store.kv_store import KvStore


# A resolve waiting for pool capacity looks again this often (a release it missed, or nothing left that frees blocks).
CAPACITY_RECHECK_S = 0.25


class Degrade(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def load_order(req_id: str, res: Hit, reservation: Any) -> LoadOrder:
    """A hit's page slots into the reservation's blocks, and its bounded artifacts into the reserved staging slots."""
    staging = reservation.staging
    return LoadOrder(req_id, list(res.page_slots), reservation.block_ids,
                     [BoundedCopy(g, staging[g][0], res.bounded_slots[g]) for g in staging], host_epoch=res.epoch)


class MissBreaker:
    """After `threshold` consecutive cold misses for a scope, stop asking the tier for `cooldown_s`."""

    def __init__(self, threshold: int, cooldown_s: float) -> None:
        self.threshold, self.cooldown_s = threshold, cooldown_s
        self._misses: dict[HashScope, int] = {}
        self._open_until: dict[HashScope, float] = {}

    def allows(self, scope: HashScope) -> bool:
        until = self._open_until.get(scope)
        if until is None:
            return True
        if time.monotonic() >= until:
            self._open_until.pop(scope, None)  # pop: resolving threads and the loop may both get here
            self._misses[scope] = 0
            return True
        return False

    def miss(self, scope: HashScope) -> bool:
        n = self._misses.get(scope, 0) + 1
        self._misses[scope] = n
        if n >= self.threshold:
            self._open_until[scope] = time.monotonic() + self.cooldown_s
            return True
        return False

    def hit(self, scope: HashScope) -> None:
        self._misses[scope] = 0


@dataclass
class Started:
    """A resolve that needs the tier: its device hit so far, the hashes and how far the tier may extend it."""

    prefix: KvPrefix
    hashes: list[bytes]
    dev: int  # pages held on the device
    cap: int  # pages the prompt may reuse
    deadline: float
    page_tokens: int


class Resolver:
    def __init__(self, store: "KvStore") -> None:
        self.store = store
        self.breaker = MissBreaker(store.config.breaker_misses, store.config.breaker_cooldown_s)

    def begin(self, rank: int, req_id: str, tokens: Sequence[int] | np.ndarray, scope: HashScope,
              policy: ResolvePolicy, cancel: CancelToken | None) -> KvPrefix | Started:
        """Everything before the tier: the finished prefix when the tier has nothing to add, else the device hit
        (held) and what to ask the tier for."""
        store = self.store
        pool = store.pools[rank]
        deadline = time.monotonic() + (store.config.resolve_deadline_s if policy.deadline_s is None
                                       else policy.deadline_s)
        if cancel is not None and cancel.cancelled:
            store.outcomes.record("resolve", req_id, "degraded", "cancelled")
            return KvPrefix(pool.probe([], 0))  # an empty hold: no I/O at all
        # Pad ids name a P/D hand-off's padded chain, which only its consumer resolves: no user prompt may.
        hashes = pool.hasher.hash_prompt(tokens, scope, pad_tail=policy.wait_for_full_hit
                                         or policy.consume_handoff_of is not None)
        n_tokens = len(tokens)
        hold = pool.probe(hashes, n_tokens, policy.reuse)
        # A restore's pages' token ids, for the device pool's KV events: the prompt as the hash just packed it (a
        # reference), which the publisher's thread reads as one buffer, where the engine's list would cost it a
        # cold Python int per id (bench/RESULTS.md, "Eighth session")
        hold.prompt_tokens = hashes.data
        P = pool.page_tokens
        cap = min(len(hashes), n_tokens // P) if policy.reuse is ReusePolicy.FULL_PAGES else (n_tokens - 1) // P
        dev_pages = hold.num_blocks
        # vLLM's prefix_cache_queries/_hits: tokens, not requests
        store.count_many(("prefix_cache_queries", n_tokens), ("prefix_cache_hits_device", dev_pages * P))
        prefix = KvPrefix(hold, device_tokens=dev_pages * P, page_hashes=hashes)
        tier = store.tier_of(rank)
        if tier is None or dev_pages >= cap or not store.spec.prefix_caching:
            store.outcomes.record("resolve", req_id, "ok", "device_only" if tier is None else "")
            return prefix
        if not tier.available:
            store.outcomes.record("resolve", req_id, "degraded", "tier_unavailable")
            return prefix
        if not policy.wait_for_full_hit and not self.breaker.allows(scope):
            store.count("breaker_skips")
            store.outcomes.record("resolve", req_id, "ok", "breaker_open")
            return prefix
        return Started(prefix, hashes, dev_pages, cap, deadline, P)

    def finish(self, req_id: str, st: Started, pages: int | Degrade) -> KvPrefix:
        """Record the resolve's one outcome and return its prefix (`pages` restored from the tier, or a degrade)."""
        if isinstance(pages, Degrade):
            self.store.count(f"resolve_degraded_{pages.reason}")
            self.store.outcomes.record("resolve", req_id, "degraded", pages.reason)
        else:
            st.prefix.host_tokens = pages * st.page_tokens
            self.store.count("prefix_cache_hits_host", st.prefix.host_tokens)
            self.store.outcomes.record("resolve", req_id, "ok")
        return st.prefix

    async def resolve(self, rank: int, req_id: str, tokens: Sequence[int] | np.ndarray, scope: HashScope,
                      policy: ResolvePolicy, cancel: CancelToken | None) -> KvPrefix:
        st = self.begin(rank, req_id, tokens, scope, policy, cancel)
        if isinstance(st, KvPrefix):
            return st
        try:
            pages: int | Degrade = await self._from_tier(rank, req_id, st.hashes, st.prefix.hold, st.dev, st.cap,
                                                          scope, policy, cancel, st.deadline)
        except Degrade as d:
            pages = d
        return self.finish(req_id, st, pages)

    async def _wait(self, aw: Awaitable[Any], deadline: float, cancel: CancelToken | None, what: str) -> Any:
        """Await `aw` until the deadline, waking early on cancellation (the token's listener sets an event)."""
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            if asyncio.iscoroutine(aw):
                aw.close()  # never started: close it rather than leave an un-awaited coroutine behind
            raise Degrade(f"deadline_{what}")
        task = asyncio.ensure_future(aw)
        waiters: list[asyncio.Future[Any]] = [task]
        cancel_ev: asyncio.Event | None = None
        if cancel is not None:
            loop = asyncio.get_running_loop()
            ev = cancel_ev = asyncio.Event()

            def on_cancel(_id: int) -> None:
                loop.call_soon_threadsafe(ev.set)

            if not cancel.add_listener(on_cancel):
                ev.set()
            waiters.append(asyncio.ensure_future(ev.wait()))
        try:
            done, _ = await asyncio.wait(waiters, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters[1:]:
                w.cancel()
        if task in done:
            return task.result()
        task.cancel()
        if cancel_ev is not None and cancel_ev.is_set():
            raise Degrade("cancelled")
        raise Degrade(f"deadline_{what}")

    async def _from_tier(self, rank: int, req_id: str, hashes: list[bytes], hold: Any, dev: int, cap: int,
                         scope: HashScope, policy: ResolvePolicy, cancel: CancelToken | None,
                         deadline: float) -> int:
        store = self.store
        tier = store.tier_of(rank)
        assert tier is not None
        pool = store.pools[rank]
        want = hashes[dev:cap]
        staging_groups = [g.name for g in store.spec.restorable_bounded_groups]
        waited_for_pool = False
        while True:
            if cancel is not None and cancel.cancelled:
                raise Degrade("cancelled")
            remaining = deadline - time.monotonic()
            try:
                # The message's own deadline runs a grace past the resolve's: an answer that comes just late is still
                # read (a late Hit's lease goes back at once) rather than answered "deadline exceeded" by the tier.
                res = await self._wait(tier.query(req_id, want, timeout=remaining + LATE_REPLY_GRACE_S,
                                                  parent=hashes[dev - 1] if dev else None), deadline,
                                       cancel, "query")
            except Degrade:
                raise
            except Exception as e:  # noqa: BLE001 - PeerDead / RemoteError / TierUnavailable
                raise Degrade(f"tier_{type(e).__name__}") from None
            if isinstance(res, Miss):
                if not policy.wait_for_full_hit:
                    # Only a cold miss (nothing on the device either) counts: a multi-turn request whose history
                    # hit the device always misses on its new tokens, and that says nothing about the tier.
                    if dev == 0 and self.breaker.miss(scope):
                        store.count("breaker_opened")
                    return 0
                await self._wait(tier.wait_key(want[-1], timeout=deadline - time.monotonic()), deadline, cancel,
                                 "full_hit")
                continue
            if isinstance(res, Loading):
                await self._wait(tier.wait_settled(res.save_id, timeout=deadline - time.monotonic()), deadline,
                                 cancel, "loading")
                continue
            assert isinstance(res, Hit)
            if policy.wait_for_full_hit and res.pages < len(want):
                tier.release_lease(res.lease_id)
                await self._wait(tier.wait_key(want[-1], timeout=deadline - time.monotonic()), deadline, cancel,
                                 "full_hit")
                continue
            groups = [g for g in staging_groups if g in res.bounded_slots]
            reservation = pool.reserve_loaded_blocks(res.pages, groups)
            if reservation is None:
                tier.release_lease(res.lease_id)  # first, so the tier can evict meanwhile
                if hold.num_blocks:
                    # Never wait for blocks while holding some: two resolves that each hold what the other needs
                    # would wait for each other until the deadline (measured: 15 s stalls in the 2-rank demo at half
                    # the working set, `resolve_degraded_deadline_pool_pressure`). The request goes on with its
                    # device hit, where the engine's admission may release holds; a resolve cannot.
                    store.count("resolve_pool_pressure_with_hold")
                    raise Degrade("pool_pressure")
                if not pool.frees_blocks_by_itself():
                    # Nothing in the pool will free a block without the engine: what is taken is held by resolves'
                    # holds (in flight, or done on one rank while another rank's resolve of the same request waits
                    # here). Waiting would last until the deadline (measured: 15 s stalls in the 2-rank demo, rank 0
                    # and rank 1 each waiting for blocks the other request's finished rank held).
                    store.count("resolve_pool_pressure_nothing_frees")
                    raise Degrade("pool_pressure")
                # A pool that cannot hold the prefix could not admit the request either: wait for capacity (this
                # resolve pins nothing meanwhile), then query again. In slices: a release between the failed
                # reservation and the waiter's subscription is not missed for longer than one, and each slice
                # checks again that something in the pool still frees blocks by itself.
                if not waited_for_pool:
                    waited_for_pool = True
                    store.count("resolve_waited_for_pool")
                try:
                    await self._wait(self._capacity(pool), min(deadline, time.monotonic() + CAPACITY_RECHECK_S),
                                     cancel, "pool_pressure")
                except Degrade as d:
                    if d.reason != "deadline_pool_pressure" or time.monotonic() >= deadline:
                        raise
                continue
            pages = await self._load(rank, req_id, hashes, hold, dev, res, reservation, policy, cancel, deadline)
            self.breaker.hit(scope)
            return pages

    async def _settle_load(self, rank: int, req_id: str, load: "asyncio.Future[Any]", reservation: Any,
                           lease_id: int, cancel: CancelToken | None, deadline: float) -> None:
        """Wait for a load order under the resolve's deadline and token. Raises `Degrade` if it failed (reservation
        and lease released at once) or if the resolve stopped waiting (both released when the copy ends, which
        `flush_loads` waits for)."""
        store = self.store
        tier = store.tier_of(rank)
        assert tier is not None

        def settle_abandoned(f: asyncio.Future[Any]) -> None:
            reservation.release()
            tier.release_lease(lease_id)
            store._loads[rank].discard(f)
            store.outcomes.record("load", req_id, "ok" if not f.cancelled() and f.exception() is None
                                  else "failed", "abandoned")

        try:
            await self._wait(asyncio.shield(load), deadline, cancel, "load")
        except Degrade:
            store.count("loads_abandoned")
            store._loads[rank].add(load)
            load.add_done_callback(settle_abandoned)
            raise
        except Exception as e:  # noqa: BLE001 - the copy failed: nothing was committed
            reservation.release()
            tier.release_lease(lease_id)
            store.outcomes.record("load", req_id, "failed", reason_of(e))
            raise Degrade("load_failed") from None

    async def _capacity(self, pool: Any) -> None:
        loop = asyncio.get_running_loop()
        ev = asyncio.Event()
        unsubscribe = pool.on_capacity_freed(lambda: loop.call_soon_threadsafe(ev.set))
        try:
            await ev.wait()
        finally:
            unsubscribe()

    async def _load(self, rank: int, req_id: str, hashes: list[bytes], hold: Any, dev: int, res: Hit,
                    reservation: Any, policy: ResolvePolicy, cancel: CancelToken | None, deadline: float) -> int:
        store = self.store
        tier = store.tier_of(rank)
        assert tier is not None
        order = load_order(req_id, res, reservation)
        # Not cancellable once submitted: the reservation travels with the copy until it settles.
        load = asyncio.ensure_future(store.copiers[rank].load(order))
        await self._settle_load(rank, req_id, load, reservation, res.lease_id, cancel, deadline)
        pool = store.pools[rank]
        pool.commit_loaded_blocks(reservation, hold, hashes[dev : dev + res.pages])
        tier.release_lease(res.lease_id, consume_handoff=policy.consume_handoff_of)
        store.outcomes.record("load", req_id, "ok")
        return res.pages
