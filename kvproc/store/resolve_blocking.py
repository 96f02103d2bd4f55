"""The blocking read path behind `KvStore.resolve_prefix_sync`: a host-hit resolve run on the caller's thread.

Why: the loop path (`store/resolve.py`) hands the resolve to the store's event loop and the result back, and each of
its tier calls wakes the loop; on a 2-vCPU host every wake-up costs tens of microseconds plus cold caches for the
code after it. A caller that blocks for the result anyway can do the common case itself, with the tier and the copy
worker reached over sockets its own thread owns (`RpcClient.request`): hash, probe, Query, reserve, Load, commit.

The common case only. Anything that has to wait goes to the loop path, which waits without a thread per wait:
a tier that answers Loading, a full-hit policy not yet satisfied, a pool that cannot take the load right now, a tier
or copier without blocking forms (`BlockingTier` / `BlockingCopier`). The lease of a declined hit is released
first, so the loop path starts clean (it queries again: one more round trip, on a path that waits anyway). A cancel
token ends either wait at once (`direct.py`: its listener wakes the poll), like the loop path's.

Speculative load (`StoreConfig.speculative_loads`): when the store already knows where the tier holds the next pages
(`SlotCache`: its own saves, earlier hits) it reserves free blocks, sends the Load from those slots and asks the
tier while the copy runs, so a host hit costs about one round trip plus the copy instead of two plus the copy. The
tier's hit then decides: the leading pages whose (slot, generation) it names are committed (why that is safe:
`kvproc/tiers/slot_cache.py`), the rest of the hit is loaded the usual way, the copies it does not confirm are
dropped with their blocks. Paged-only specs (a bounded group's staging slot depends on the answer).

Verified load (`StoreConfig.verified_loads`): when the slot cache knows *every* wanted page and the tier publishes
its page-slot table, the pages are checked against the table before the Load is ordered and again after its reply
(`kvproc/tiers/slot_table.py`) and no Query is sent at all: one round trip, no lease; only what does not verify is
asked of the tier. Plain resolves only (a hand-off's consumption and a full-hit wait are the tier's business).

Same rules as the loop path: one deadline for the whole resolve; degrade reasons in stats, never in the result; the
lease released on every path that does not consume it (a query answered after the resolve stopped waiting included:
its late Hit's lease is released when it arrives); a load is not cancellable: when the deadline passes or the token
fires during it, the resolve degrades to the device hit and the load is abandoned -- counted, its reservation and
lease kept until the worker's reply arrives (on another thread: `on_late`), and `flush_loads` waits for it.
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from kvproc.core.hashing import HashScope
from kvproc.ipc import messages as m
from kvproc.ipc.cancel import CancelToken
from kvproc.ipc.direct import LATE
from kvproc.ipc.errors import reason_of
from kvproc.ipc.orders import LoadOrder
from kvproc.store.resolve import Degrade, Resolver, Started, load_order, tier_epoch
from kvproc.store.types import KvPrefix, ResolvePolicy
from kvproc.tiers.api import BlockingCopier, BlockingTier
from kvproc.tiers.host_index import Hit, Miss

if TYPE_CHECKING:
    from kvproc.store.kv_store import KvStore


class _UseLoop(Exception):
    """This resolve has to wait for something: the loop path takes it over (nothing is held on the tier)."""


class BlockingResolver:
    # Reserve a full hit's blocks (free ones only) while the query flies; False reserves after the answer (the A/B
    # knob behind bench/RESULTS.md "Control path": 3-8% faster in flight).
    reserve_in_flight = True

    def __init__(self, store: "KvStore", resolver: Resolver) -> None:
        self.store = store
        self.resolver = resolver  # shares the miss-breaker, the outcomes and the front half (`begin`)
        # Decided once (the store is frozen after build; an isinstance on a runtime Protocol costs ~20 us a call).
        self.capable = bool(store.tiers) and all(isinstance(t, BlockingTier) for t in store.tiers) and bool(
            store.copiers) and all(isinstance(c, BlockingCopier) for c in store.copiers)

    def resolve(self, rank: int, req_id: str, tokens: Sequence[int] | np.ndarray, scope: HashScope,
                policy: ResolvePolicy, cancel: CancelToken | None) -> KvPrefix:
        out = self.resolve_or_continue(rank, req_id, tokens, scope, policy, cancel)
        return out if isinstance(out, KvPrefix) else out.result()

    def resolve_or_continue(self, rank: int, req_id: str, tokens: Sequence[int] | np.ndarray, scope: HashScope,
                            policy: ResolvePolicy,
                            cancel: CancelToken | None) -> KvPrefix | concurrent.futures.Future[KvPrefix]:
        """The prefix, or -- when the resolve has to wait -- the future of its continuation on the store's loop (a
        resolve thread hands it over and is free again: `KvStore.submit_resolve`)."""
        store = self.store
        st = self.resolver.begin(rank, req_id, tokens, scope, policy, cancel)
        if isinstance(st, KvPrefix):
            return st
        if self.capable:
            pages: int | Degrade | None
            try:
                pages = self._from_tier(rank, req_id, st, store.tiers[rank], store.copiers[rank], scope, policy,
                                        cancel)
            except Degrade as d:
                pages = d
            except _UseLoop:
                pages = None
            except Exception as e:  # a bug, not a degrade: still one recorded outcome, and the hold goes back
                store.outcomes.record("resolve", req_id, "failed", type(e).__name__)
                st.prefix.hold.release()
                raise
            if pages is not None:
                return self.resolver.finish(req_id, st, pages)
        store.count("resolve_via_loop")
        return store._loop.submit(self.resolver.resolve_started(rank, req_id, st, scope, policy, cancel))

    def _from_tier(self, rank: int, req_id: str, st: Started, tier: Any, copier: Any, scope: HashScope,
                   policy: ResolvePolicy, cancel: CancelToken | None) -> int:
        pool = self.store.pools[rank]
        want = st.hashes[st.dev : st.cap]
        slots, gens, skip_query = self.resolver.speculation(rank, tier, want, policy)
        if slots:
            spec = pool.reserve_loaded_blocks(len(slots), free_only=True)  # a wasted guess evicts nothing
            if spec is not None:
                self.store.count("speculative_loads_started")
                if skip_query:
                    return self._verified(rank, req_id, st, tier, copier, scope, policy, cancel, slots, gens, spec)
                return self._speculate(rank, req_id, st, tier, copier, scope, policy, cancel, want, slots, gens,
                                       spec)
        return self._queried(rank, req_id, st, tier, copier, scope, policy, cancel)

    def _queried(self, rank: int, req_id: str, st: Started, tier: Any, copier: Any, scope: HashScope,
                 policy: ResolvePolicy, cancel: CancelToken | None) -> int:
        """The plain host hit: query, reserve (in flight when it can), load, commit."""
        store = self.store
        pool = store.pools[rank]
        want = st.hashes[st.dev : st.cap]
        early: list[Any] = []  # the reservation made while the query is in flight, if any

        def reserve_early() -> None:
            # Fill the query's round trip: reserve the destination blocks of a full hit now, from free blocks only (a
            # miss must not have evicted anything). Paged-only specs: a staging slot depends on the answer.
            if self.reserve_in_flight and not store.spec.restorable_bounded_groups:
                r = pool.reserve_loaded_blocks(len(want), free_only=True)
                if r is not None:
                    early.append(r)

        try:
            try:
                answer: Any = tier.query_blocking(req_id, want, deadline=st.deadline, cancel=cancel,
                                                  overlap=reserve_early,
                                                  parent=st.hashes[st.dev - 1] if st.dev else None)
            except Exception as e:  # noqa: BLE001 - PeerDead / RemoteError / abandoned: the prefix stays as it is
                answer = e
            res = self._hit_or_raise(answer, st, tier, scope, policy, cancel, len(want))
            if res is None:
                return 0
            if early:
                reservation = early.pop()
                pool.trim_reservation(reservation, res.pages)
                store.count("resolve_reserved_in_flight")
            else:
                groups = [g.name for g in store.spec.restorable_bounded_groups if g.name in res.bounded_slots]
                reservation = pool.reserve_loaded_blocks(res.pages, groups)
            if reservation is None:
                tier.release_lease(res.lease_id)
                raise _UseLoop  # pool pressure: the loop waits on the pool's capacity waiter
            return self._load(rank, req_id, st, tier, copier, scope, policy, res, reservation, cancel)
        finally:
            for r in early:  # not used: a miss, a declined hit or a failure
                r.release()

    def _hit_or_raise(self, answer: Any, st: Started, tier: Any, scope: HashScope, policy: ResolvePolicy,
                      cancel: CancelToken | None, wanted: int) -> Hit | None:
        """The query's answer (or the exception it raised) as a Hit to load, None for a miss; raises `Degrade` or
        `_UseLoop` for everything else, with a Hit's lease released first."""
        if isinstance(answer, Exception):  # PeerDead / RemoteError / abandoned: the prefix stays as it is
            if cancel is not None and cancel.cancelled:
                raise Degrade("cancelled")
            if time.monotonic() >= st.deadline:
                raise Degrade("deadline_query")
            raise Degrade(f"tier_{type(answer).__name__}")
        if cancel is not None and cancel.cancelled:
            if isinstance(answer, Hit):
                tier.release_lease(answer.lease_id)
            raise Degrade("cancelled")
        if isinstance(answer, Miss):
            if policy.wait_for_full_hit:
                raise _UseLoop
            if st.dev == 0 and self.resolver.breaker.miss(scope):  # cold misses only, as on the loop path
                self.store.count("breaker_opened")
            return None
        if not isinstance(answer, Hit):
            raise _UseLoop  # Loading: the loop waits for the tier's notification
        if policy.wait_for_full_hit and answer.pages < wanted:
            tier.release_lease(answer.lease_id)
            raise _UseLoop
        return answer

    def _verified(self, rank: int, req_id: str, st: Started, tier: Any, copier: Any, scope: HashScope,
                  policy: ResolvePolicy, cancel: CancelToken | None, slots: list[int], gens: list[int],
                  spec: Any) -> int:
        """Every wanted page is in the slot cache and verified against the tier's slot table: load, verify again,
        and ask the tier only for what did not verify (`kvproc/tiers/slot_table.py`)."""
        order = LoadOrder(req_id, slots, spec.block_ids, [], host_epoch=tier_epoch(tier))
        self._run_load(rank, req_id, st, tier, copier, order, spec, lambda: None, cancel)
        ok = self.resolver.keep_verified(rank, req_id, st.hashes, st.prefix.hold, st.dev, slots, gens, spec)
        if ok == len(slots):
            self.resolver.breaker.hit(scope)
            return ok
        try:  # the rest goes the usual way, from where the verified pages end
            return ok + self._queried(rank, req_id, replace(st, dev=st.dev + ok), tier, copier, scope, policy,
                                      cancel)
        except (Degrade, _UseLoop):
            if not ok:
                raise
            self.store.count("verified_rest_declined")  # keep what verified rather than start over on the loop
            return ok

    def _speculate(self, rank: int, req_id: str, st: Started, tier: Any, copier: Any, scope: HashScope,
                   policy: ResolvePolicy, cancel: CancelToken | None, want: list[bytes], slots: list[int],
                   gens: list[int], spec: Any) -> int:
        """Load the pages the slot cache knows while the tier is asked (module docstring); keep what the hit
        confirms, load the rest of the hit the usual way."""
        store = self.store
        answer: list[Any] = []  # the query's answer or exception; set before the load's wait starts

        def ask() -> None:  # runs once the Load is on its way
            try:
                answer.append(tier.query_blocking(req_id, want, deadline=st.deadline, cancel=cancel,
                                                  parent=st.hashes[st.dev - 1] if st.dev else None))
            except Exception as e:  # noqa: BLE001 - judged after the load, like the plain path's
                answer.append(e)

        def lease() -> int | None:  # the query's lease, if it answered Hit (it has, whenever the load's wait began)
            return answer[0].lease_id if answer and isinstance(answer[0], Hit) else None

        order = LoadOrder(req_id, slots, spec.block_ids, [], host_epoch=tier_epoch(tier))
        self._run_load(rank, req_id, st, tier, copier, order, spec, lease,
                       cancel, overlap=ask)
        try:
            res = self._hit_or_raise(answer[0] if answer else RuntimeError("no answer"), st, tier, scope, policy,
                                     cancel, len(want))
        except BaseException:
            spec.release()
            store.outcomes.record("load", req_id, "ok", "speculative_unused")
            raise
        ok, rest, reservation = self.resolver.keep_confirmed(rank, req_id, st.hashes, st.prefix.hold, st.dev, res,
                                                             slots, gens, spec, policy)
        if rest is None:
            if res is not None:
                self.resolver.breaker.hit(scope)
            return ok
        # The hit reaches further than what was confirmed: load the rest as usual (the lease covers it all).
        try:
            return ok + self._load(rank, req_id, replace(st, dev=st.dev + ok), tier, copier, scope, policy, rest,
                                   reservation, cancel)
        except Degrade:  # the rest's load failed or was abandoned (its outcome is recorded): the confirmed part stays
            store.count("speculative_rest_failed")
            return ok

    def _load(self, rank: int, req_id: str, st: Started, tier: Any, copier: Any, scope: HashScope,
              policy: ResolvePolicy, res: Hit, reservation: Any, cancel: CancelToken | None) -> int:
        store = self.store
        self._run_load(rank, req_id, st, tier, copier, load_order(req_id, res, reservation), reservation,
                       lambda: res.lease_id, cancel)
        store.pools[rank].commit_loaded_blocks(reservation, st.prefix.hold, st.hashes[st.dev : st.dev + res.pages])
        tier.release_lease(res.lease_id, consume_handoff=policy.consume_handoff_of)
        if store.config.speculative_loads and res.page_gens:  # the next resolve of these pages may speculate
            store.slot_caches[rank].learn(st.hashes[st.dev : st.dev + res.pages], res.page_slots, res.page_gens)
        store.outcomes.record("load", req_id, "ok")
        self.resolver.breaker.hit(scope)
        return int(res.pages)

    def _run_load(self, rank: int, req_id: str, st: Started, tier: Any, copier: Any, order: LoadOrder,
                  reservation: Any, lease: Callable[[], int | None], cancel: CancelToken | None,
                  overlap: Callable[[], None] | None = None) -> None:
        """Send a load order and wait for it (`overlap` runs while it flies). Returns once the bytes are in the
        reservation's blocks; raises `Degrade` otherwise, with the reservation and the lease (`lease()`, if any)
        released: at once if the copy failed, or when the worker answers if the resolve stopped waiting first (the
        abandoned load counts in `flush_loads` until then)."""
        store = self.store
        loads = store._loads[rank]
        late: list[concurrent.futures.Future[None]] = []  # made only if the resolve stops waiting (rare)
        settled = [False]

        def give_back() -> None:
            reservation.release()
            lease_id = lease()
            if lease_id is not None:
                tier.release_lease(lease_id)

        def settle_abandoned(reply: Any) -> None:  # the worker's reply to a load the resolve stopped waiting for
            give_back()
            store.outcomes.record("load", req_id, "ok" if isinstance(reply, m.Ok) else "failed", "abandoned")
            with store._late_lock:
                settled[0] = True
                fut = late[0] if late else None
            if fut is not None:
                loads.discard(fut)
                fut.set_result(None)

        if cancel is not None and cancel.cancelled:  # cancelled since the query: no order goes out at all
            give_back()
            raise Degrade("cancelled")
        try:
            copied = copier.load_blocking(order, wait_until=st.deadline, on_late=settle_abandoned, cancel=cancel,
                                          overlap=overlap)
        except Exception as e:  # noqa: BLE001 - the copy failed (or its worker died): nothing was committed
            give_back()
            store.outcomes.record("load", req_id, "failed", reason_of(e))
            raise Degrade("load_failed") from None
        if copied is LATE:
            store.count("loads_abandoned")
            fut: concurrent.futures.Future[None] = concurrent.futures.Future()
            with store._late_lock:  # the reply may have come already: then there is nothing left to wait for
                if not settled[0]:
                    late.append(fut)
                    loads.add(fut)  # flush_loads waits for it from now on
            raise Degrade("cancelled" if cancel is not None and cancel.cancelled else "deadline_load")
