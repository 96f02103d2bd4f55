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

import concurrent.futures
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvproc.ipc.errors import reason_of
from kvproc.ipc.segment import Segment, SegmentBusyError
from kvproc.tiers import save_fence
from kvproc.tiers.host_index import Hit, Loading, SaveClass, SaveTicket, Shed
from kvproc.tiers.slot_table import GEN, ROW_BYTES, ROWS
from kvproc.workers.copy_exec import fence_row, host_region

# A lease older than this is not trusted for a copy: the tier's leases live 30 s by default (`kvproc up
# --lease-ttl`), and an engine may hold a request back (no blocks for it) longer than that between its lookup and
# its load. Past it the load is reported failed (vLLM recomputes), whatever the slots hold.
LEASE_SAFE_S = 10.0

if TYPE_CHECKING:
    from kvproc.store.kv_store import KvStore


class HostDirect:
    def __init__(self, store: "KvStore", segment: str, rank: int = 0) -> None:
        tier = store.tier_of(rank)
        if tier is None:
            raise ValueError(f"rank {rank} has no host tier")
        self.store, self.tier, self.layout = store, tier, tier.layout
        self._segment = Segment.attach(segment)
        host = self._segment.numpy(np.uint8)
        self._fences = fence_row(host, self.layout)
        self._gens: np.ndarray | None = None  # each page slot's generation (`kvproc/tiers/slot_table.py`)
        if self.layout.slot_table_offset >= 0:
            off, n = self.layout.slot_table_offset, self.layout.page_slots
            self._gens = host[off: off + ROWS * n * ROW_BYTES].view(np.int64).reshape(ROWS, n)[GEN]
        self.views: dict[str, np.ndarray] = {}
        for r in self.layout.regions:
            flat = host_region(host, self.layout, r.arena)
            assert flat is not None
            self.views[r.arena] = flat.reshape(r.slots, r.unit_bytes)
        del host
        self.timeout_s = store.config.tier_call_timeout_s

    # -- loads ------------------------------------------------------------------------------------------------------
    def lookup(self, req_id: str, hashes: Sequence[bytes]) -> concurrent.futures.Future[Hit | None]:
        """Lease the longest prefix of `hashes` the tier holds (with a complete checkpoint where the model has state
        groups): a `Hit` (its lease held until `release`) or None. A page still being saved is waited for once."""
        return self.store.submit(self._lookup(req_id, list(hashes)))

    async def _lookup(self, req_id: str, hashes: list[bytes]) -> Hit | None:
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

    def intact(self, slots: Sequence[int], gens: Sequence[int], leased_at: float, now: float) -> bool:
        """After a copy out of leased slots: the lease was young enough to be alive (`LEASE_SAFE_S`), and no save
        was handed one of the slots meanwhile (a save bumps a slot's generation before it may write it). False: the
        bytes copied may be another page's."""
        if now - leased_at > LEASE_SAFE_S:
            return False
        if self._gens is None or not gens:
            return True
        return bool(np.array_equal(self._gens[np.asarray(slots, dtype=np.int64)], np.asarray(gens, dtype=np.int64)))

    def release(self, lease_id: int) -> None:
        self.store.call(self.tier.release_lease, lease_id)

    # -- saves ------------------------------------------------------------------------------------------------------
    def save(self, req_id: str, keys: Sequence[bytes], write: Callable[[SaveTicket], None], *,
             bounded_groups: Sequence[str] = (), save_class: SaveClass = SaveClass.CACHEABLE,
             parent: bytes | None = None, tokens: Sequence[int] | None = None) -> bool:
        """Reserve slots for `keys` (and `bounded_groups`' artifacts at the last key), let `write(ticket)` fill the
        slots it names (`ticket.page_slots`: None where the page is there already) while the save's fence is held,
        and commit. True when the pages (and artifacts) are in the tier. `parent` (the page before `keys[0]`) and
        `tokens` (the pages' token ids) feed the tier's KV events, where it publishes them."""
        state, reason = "failed", "unknown"
        ticket: SaveTicket | Shed | None = None
        try:
            if not self.tier.available:
                state, reason = "shed", "tier_unavailable"
                return False
            ticket = self.store.submit(self.tier.reserve_save(
                req_id, list(keys), list(bounded_groups), save_class, timeout=self.timeout_s,
                token_ids=np.asarray(tokens, dtype=np.int64) if tokens is not None and self.tier.wants_token_ids
                else None, parent_key=parent if self.tier.wants_parent_key else None)).result(2 * self.timeout_s)
            if isinstance(ticket, Shed):
                state, reason = "shed", "tier_full"
                return False
            save_fence.claim(self._fences, ticket.fence, ticket.fence_token)
            try:
                write(ticket)
            finally:
                save_fence.release(self._fences, ticket.fence, ticket.fence_token)
            if self.store.submit(self.tier.commit_save(ticket.save_id, timeout=self.timeout_s)).result(
                    2 * self.timeout_s):
                state, reason = "ok", ""
                return True
            reason, ticket = "commit_refused", None  # the tier gave the slots back first: nothing to abort
            return False
        except Exception as e:  # noqa: BLE001 - every failure becomes a recorded outcome
            reason = reason_of(e)
            if isinstance(ticket, SaveTicket):
                self.store.call(self.tier.abort_save, ticket.save_id, False)
            return False
        finally:
            self.store.count(f"save_{state}")
            self.store.outcomes.record("save", req_id, state, reason)

    def close(self) -> None:
        """Unmap the tier's segment; while a caller still holds a view of it, the mapping stays (freed with the
        process) rather than pull memory from under that view."""
        self.views.clear()
        self._fences = self._gens = None
        try:
            self._segment.close()
        except SegmentBusyError:
            pass
