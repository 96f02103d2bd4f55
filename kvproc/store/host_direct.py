"""`HostDirect`: the host tier for an engine that owns its KV blocks and moves the bytes itself (vLLM's connector).

kvproc's own resolve restores into its device pool and its saves copy out of it. An engine whose scheduler allocates
its own blocks (vLLM's) would need one more copy each way through such a pool. This is the other form, one copy per
page each way: a lookup leases the tier's pages of a prefix (nothing copied; a leased entry is never evicted), the
engine copies the leased slots into the blocks it allocated and releases the lease; a save reserves slots, the engine
writes them while it holds the save's fence word (`kvproc/tiers/save_fence.py`: a slot the tier has taken back is
never written), and commits. The tier's index, leases, fences, TTLs and KV events are the same as for every other
save and load; each save and lookup ends in a recorded outcome with its request id.

The engine maps the tier's segment (`views`: each stored arena's slots as rows of bytes). Calls block the calling
thread (the connector's mover thread, or its scheduler for a lookup's result): their work runs on the store's loop.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvproc.ipc.errors import reason_of
from kvproc.store.tier_slots import TierSlots
from kvproc.store.types import check_retain_s
from kvproc.tiers.host_index import Hit, Loading, SaveClass, SaveTicket, Shed

if TYPE_CHECKING:
    from kvproc.store.kv_store import KvStore

__all__ = ["HostDirect"]


class HostDirect:
    def __init__(self, store: "KvStore", segment: str, rank: int = 0) -> None:
        tier = store.tier_of(rank)
        if tier is None:
            raise ValueError(f"rank {rank} has no host tier")
        self.store, self.tier, self.layout = store, tier, tier.layout
        self.segment = segment
        self.slots = TierSlots(segment, tier.layout)
        self.views = self.slots.views
        # The tier's attachment these views are of (`remap_if_replaced`; a tier in this process is never replaced).
        self.epoch: int = getattr(tier, "epoch", 0)
        self.timeout_s = store.config.tier_call_timeout_s

    # -- loads ------------------------------------------------------------------------------------------------------
    def lookup(self, req_id: str, hashes: Sequence[bytes]) -> concurrent.futures.Future[Hit | None]:
        """Lease the longest prefix of `hashes` the tier holds (with a complete checkpoint where the model has state
        groups): a `Hit` (its lease held until `release`) or None. A page still being saved is waited for once."""
        return self.store.submit(self.lease_prefix(req_id, list(hashes)))

    async def lease_prefix(self, req_id: str, hashes: list[bytes]) -> Hit | None:
        """`lookup` on the store's loop."""
        if not hashes or not self.tier.available:
            return None
        try:
            got = await self.tier.query(req_id, hashes, timeout=self.timeout_s)
            if isinstance(got, Loading):  # a save of these pages is landing: its commit is a moment away
                await self.tier.wait_settled(got.save_id, timeout=self.timeout_s)
                got = await self.tier.query(req_id, hashes, timeout=self.timeout_s)
        except Exception as e:  # noqa: BLE001 - a failed lookup is a miss, recorded
            self.store.outcomes.record("resolve", req_id, "degraded", reason_of(e))
            return None
        if isinstance(got, Hit) and got.pages:
            self.store.outcomes.record("resolve", req_id, "ok")
            return got
        if isinstance(got, Hit):
            self.tier.release_lease(got.lease_id)
        self.store.outcomes.record("resolve", req_id, "ok", "miss")
        return None

    def remap_if_replaced(self) -> TierSlots | None:
        """The tier was replaced (`kvproc up` restarted on the same runtime dir, re-attached by the store: another
        `RemoteTier.epoch`): map the new tier's segment in place of the old one's and return the old mapping, for the
        caller to close once it dropped what it took from `views`; None when nothing changed. Call it from the one
        thread that copies (the old views must not be in use)."""
        epoch, segment = getattr(self.tier, "epoch", 0), getattr(self.tier, "segment", "")
        if epoch == self.epoch or not segment:
            return None
        old = self.slots
        self.slots = TierSlots(segment, self.tier.layout)
        self.segment, self.layout, self.views, self.epoch = segment, self.tier.layout, self.slots.views, epoch
        return old

    def intact(self, slots: Sequence[int], gens: Sequence[int], leased_at: float, now: float) -> bool:
        return self.slots.intact(slots, gens, leased_at, now)

    def release(self, lease_id: int) -> None:
        self.store.call(self.tier.release_lease, lease_id)

    # -- saves ------------------------------------------------------------------------------------------------------
    def save(self, req_id: str, keys: Sequence[bytes], write: Callable[[SaveTicket], None], *,
             bounded_groups: Sequence[str] = (), save_class: SaveClass = SaveClass.CACHEABLE,
             parent: bytes | None = None, tokens: Sequence[int] | None = None, retain_s: float | None = None) -> bool:
        """Reserve slots for `keys` (and `bounded_groups`' artifacts at the last key), let `write(ticket)` fill the
        slots it names (`ticket.page_slots`: None where the page is there already) while the save's fence is held,
        and commit. True when the pages (and artifacts) are in the tier. `parent` (the page before `keys[0]`) and
        `tokens` (the pages' token ids) feed the tier's KV events, where it publishes them. `retain_s`: the request's
        retention hint (`KvStore.seal`); an engine passing it sends every page of the prompt from its first, so
        that the tier re-ranks the ones it holds."""
        ticket = self.reserve(req_id, keys, bounded_groups=bounded_groups, save_class=save_class, parent=parent,
                              tokens=tokens, retain_s=retain_s)
        if ticket is None:
            return False
        try:
            self.slots.write_fenced(ticket.fence, ticket.fence_token, lambda: write(ticket))
        except Exception as e:  # noqa: BLE001 - every failure becomes a recorded outcome
            self.abort(ticket, reason_of(e))
            return False
        return self.commit(ticket)

    def reserve(self, req_id: str, keys: Sequence[bytes], *, bounded_groups: Sequence[str] = (),
                save_class: SaveClass = SaveClass.CACHEABLE, parent: bytes | None = None,
                tokens: Sequence[int] | None = None, retain_s: float | None = None) -> SaveTicket | None:
        """The first half of a save whose bytes another process may write (`TierSlots.write_fenced` with the
        ticket's fence): the slots, or None (the outcome is recorded: the tier is away or full)."""
        return self.store.submit(self.reserve_async(req_id, keys, bounded_groups=bounded_groups,
                                                    save_class=save_class, parent=parent, tokens=tokens,
                                                    retain_s=retain_s)).result()

    async def reserve_async(self, req_id: str, keys: Sequence[bytes], *, bounded_groups: Sequence[str] = (),
                            save_class: SaveClass = SaveClass.CACHEABLE, parent: bytes | None = None,
                            tokens: Sequence[int] | None = None, retain_s: float | None = None) -> SaveTicket | None:
        """`reserve` on the store's loop (it ends within the tier call's deadline)."""
        retain = check_retain_s(retain_s, save_class)
        hint: dict[str, float] = {} if retain is None else {"retain_s": retain}  # only when given, as `KvStore._save`
        if not self.tier.available:
            self._settled(req_id, "shed", "tier_unavailable")
            return None
        try:
            ticket = await asyncio.wait_for(self.tier.reserve_save(
                req_id, list(keys), list(bounded_groups), save_class, timeout=self.timeout_s,
                token_ids=np.asarray(tokens, dtype=np.int64) if tokens is not None and self.tier.wants_token_ids
                else None, parent_key=parent if self.tier.wants_parent_key else None, **hint), 2 * self.timeout_s)
        except Exception as e:  # noqa: BLE001 - a failed reservation is a lost save, recorded
            self._settled(req_id, "failed", reason_of(e))
            return None
        if isinstance(ticket, Shed):
            self._settled(req_id, "shed", "tier_full")
            return None
        return ticket

    async def retain(self, req_id: str, keys: Sequence[bytes], retain_s: float) -> int:
        """A retention hint for the prefix of `keys` the tier holds: those pages are held and re-ranked under it at
        once (pages a save still writes take it at that save's commit); nothing is copied, so the engine's blocks are
        not needed. Where the tier lost a page, its pages from there on are no prefix hit anyway: the hint stops there
        (the reservation that found the loss is given back, and the prefix before it reserved again). Returns the
        pages it reached (0: none, the outcome recorded)."""
        n = len(keys)
        while n:
            ticket = await self.reserve_async(req_id, keys[:n], retain_s=retain_s)
            if ticket is None:  # recorded (shed or failed)
                return 0
            lost = next((i for i, s in enumerate(ticket.page_slots) if s is not None), None)
            if lost is None:
                return n if await self.commit_async(ticket) else 0
            self._abort_here(ticket.save_id)
            self._settled(req_id, "degraded", "retain_prefix_lost")
            n = lost
        return 0

    def commit(self, ticket: SaveTicket) -> bool:
        """The written slots become the tier's pages: True, or False (recorded) when the tier refused (it took the
        slots back first: a stall past the save's TTL)."""
        try:
            return self.store.submit(self.commit_async(ticket)).result(3 * self.timeout_s)
        except Exception as e:  # noqa: BLE001 - the store's loop is gone or stuck: a lost save, recorded
            self.abort(ticket, reason_of(e))
            return False

    async def commit_async(self, ticket: SaveTicket) -> bool:
        """`commit` on the store's loop (it ends within twice the tier call's deadline)."""
        try:
            ok = await asyncio.wait_for(self.tier.commit_save(ticket.save_id, timeout=self.timeout_s),
                                        2 * self.timeout_s)
        except Exception as e:  # noqa: BLE001 - its slots go back (else the tier's TTL takes them), recorded
            self._abort_here(ticket.save_id)
            self._settled(ticket.req_id, "failed", reason_of(e))
            return False
        self._settled(ticket.req_id, "ok" if ok else "failed", "" if ok else "commit_refused")
        return bool(ok)

    def abort(self, ticket: SaveTicket, reason: str) -> None:
        """A reserved save whose bytes were not (all) written: its slots go back, and the outcome says why."""
        try:
            self.store.call(self._abort_here, ticket.save_id)
        except Exception:  # noqa: BLE001 - the store's loop is gone: the tier's TTL takes the slots back
            pass
        self._settled(ticket.req_id, "failed", reason)

    def _abort_here(self, save_id: int) -> None:
        """`abort`'s call to the tier, on the store's loop (the caller is on it)."""
        try:
            self.tier.abort_save(save_id, False)
        except Exception:  # noqa: BLE001 - the tier's TTL takes the slots back
            pass

    def _settled(self, req_id: str, state: str, reason: str) -> None:
        self.store.count(f"save_{state}")
        self.store.outcomes.record("save", req_id, state, reason)

    def close(self) -> None:
        self.slots.close()
