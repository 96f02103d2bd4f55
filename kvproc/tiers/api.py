"""What the store needs from a tier and from a copy worker, as two small async protocols.

Two implementations of each: in-process (`kvproc.store.local_tier`: the same `HostIndex` and `CopyExecutor`, no process
boundary; used by unit tests of the store's side of the contract and by single-process embeddings) and remote
(`kvproc.tiers.remote`: the host-tier and copy-worker processes over kvproc's IPC). All methods run on the store's
event loop. Fire-and-forget calls (`release_lease`, `commit_save`, ...) never raise: a dead peer's state is reclaimed
by its TTL or dies with it.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from kvproc.ipc.orders import LoadOrder, SaveOrder, SlotCopy
from kvproc.tiers.host_index import QueryResult, SaveClass, SaveTicket, Shed
from kvproc.tiers.layout import HostLayout

# A query's message deadline runs this far past the resolve's own: an answer that comes just after the resolve gave up
# is still produced and read (a late Hit's lease then goes straight back) instead of being refused by the tier.
LATE_REPLY_GRACE_S = 1.0


class TierUnavailable(RuntimeError):
    """The tier is down (its process died or never came up): the store degrades to device-only prefix caching."""


class Tier(Protocol):
    layout: HostLayout
    # The tier's KV events carry token ids: `reserve_save` wants the pages' tokens (`token_ids`); False, the store
    # does not even slice them.
    wants_token_ids: bool
    # The tier publishes KV events: `reserve_save` wants the save's parent page (`parent_key`: the prompt's page
    # before the save's first), which its BlockStored name as the first run's parent; False, the store sends none.
    wants_parent_key: bool

    @property
    def available(self) -> bool: ...

    async def query(self, req_id: str, hashes: Sequence[bytes], *, timeout: float,
                    parent: bytes | None = None) -> QueryResult:
        """`parent`: the prompt's page before `hashes[0]` (None at its first page); a tier that publishes KV events
        parents the pages it pulls for this query on it."""
        ...

    async def wait_settled(self, save_id: int, *, timeout: float) -> bool:
        """Wait until a pending save commits or aborts (the tier notifies; no polling). False on timeout."""
        ...

    async def wait_key(self, key: bytes, *, timeout: float) -> bool:
        """Wait until an entry for `key` is committed (a hand-off producer's save landed). False on timeout."""
        ...

    def release_lease(self, lease_id: int, consume_handoff: str | None = None) -> None: ...

    async def reserve_save(self, req_id: str, keys: Sequence[bytes], bounded_groups: Sequence[str],
                           save_class: SaveClass, *, timeout: float, token_ids: np.ndarray | None = None,
                           parent_key: bytes | None = None, retain_s: float | None = None) -> SaveTicket | Shed:
        """`retain_s`: the request's retention hint (`KvStore.seal`), for the tier's eviction policy; None: none."""
        ...

    async def commit_save(self, save_id: int, *, timeout: float) -> bool:
        """Make a save's entries visible (its copy landed). False: the tier had given the save's slots back (TTL,
        abort) and refused the commit -- the save failed, whatever its copy said."""
        ...

    def abort_save(self, save_id: int, writer_dead: bool = False) -> None: ...

    def revoke_handoff(self, producer_req_id: str, consumed: bool = False) -> None: ...

    async def stats(self) -> dict[str, int]: ...

    def close(self) -> None: ...


class Copier(Protocol):
    """One rank's copy worker. A submitted order is not cancellable: the awaitable always ends with its real outcome
    (returns the bytes copied, or raises)."""

    async def save(self, order: SaveOrder) -> int: ...

    async def load(self, order: LoadOrder) -> int: ...

    async def device_copy(self, copies: Sequence[SlotCopy], after_event: bytes | None = None) -> int:
        """`after_event`: the engine's step event (a CUDA IPC handle) the copies run after; None: none."""
        ...

    def close(self) -> None: ...
