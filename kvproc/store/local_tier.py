"""In-process tier and copier: the real `HostIndex` and `CopyExecutor` without a process boundary.

Used where the process topology is not the point: unit tests of the store's side of the contract, and embeddings
that want a host tier inside the scheduler process. The host arena is plain (or shared) memory here.
"""

from __future__ import annotations

import asyncio
from typing import Any, Sequence

import numpy as np

from kvproc.core.eviction import HOST_DEFAULT
from kvproc.ipc.orders import LoadOrder, SaveOrder, SlotCopy
from kvproc.tiers.host_index import HostIndex, QueryResult, SaveClass, SaveTicket, Shed
from kvproc.tiers.layout import HostLayout
from kvproc.tiers.slot_table import ROWS
from kvproc.workers.copy_exec import CopyExecutor


class LocalTier:
    def __init__(self, layout: HostLayout, required_bounded: Sequence[str], *, host: np.ndarray | None = None,
                 lease_ttl_s: float = 30.0, handoff_ttl_s: float = 300.0, eviction: str = HOST_DEFAULT) -> None:
        self.layout = layout
        self.wants_token_ids = self.wants_parent_key = False  # an in-process tier publishes no KV events
        self.host = host if host is not None else np.zeros(layout.total_bytes, dtype=np.uint8)
        # The slot table lives in the arena, as in the host-tier process (the direct path reads its generations and
        # save fences there: `store/tier_slots.py`).
        self.slot_table: np.ndarray | None = None
        if layout.slot_table_offset >= 0:
            off = layout.slot_table_offset
            self.slot_table = self.host[off : off + layout.slot_table_bytes].view(np.int64).reshape(ROWS, -1)
        self.index = HostIndex(layout.page_slots, dict(layout.bounded_slots), required_bounded=required_bounded,
                               lease_ttl_s=lease_ttl_s, handoff_ttl_s=handoff_ttl_s, slot_table=self.slot_table,
                               eviction=eviction)
        self.index.on_settled = self._settled
        self._save_waiters: dict[int, list[asyncio.Future[bool]]] = {}
        self._key_waiters: dict[bytes, list[asyncio.Future[bool]]] = {}
        self.up = True

    @property
    def available(self) -> bool:
        return self.up

    def _settled(self, ticket: SaveTicket, ok: bool) -> None:
        for fut in self._save_waiters.pop(ticket.save_id, []):
            if not fut.done():
                fut.set_result(ok)
        if ok:
            for k in ticket.keys:
                for fut in self._key_waiters.pop(k, []):
                    if not fut.done():
                        fut.set_result(True)

    async def _wait(self, table: dict[Any, list[asyncio.Future[bool]]], key: object, timeout: float) -> bool:
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        table.setdefault(key, []).append(fut)
        try:
            return await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            return False
        finally:
            waiters = table.get(key)
            if waiters is not None and fut in waiters:
                waiters.remove(fut)
                if not waiters:
                    del table[key]

    async def query(self, req_id: str, hashes: Sequence[bytes], *, timeout: float,
                    parent: bytes | None = None) -> QueryResult:
        self.index.reap()
        return self.index.query(req_id, hashes)

    async def wait_settled(self, save_id: int, *, timeout: float) -> bool:
        if save_id not in self.index.saves:
            return True
        return await self._wait(self._save_waiters, save_id, timeout)

    async def wait_key(self, key: bytes, *, timeout: float) -> bool:
        if key in self.index.entries:
            return True
        return await self._wait(self._key_waiters, key, timeout)

    def release_lease(self, lease_id: int, consume_handoff: str | None = None) -> None:
        self.index.release_lease(lease_id, consume_handoff=consume_handoff)

    async def reserve_save(self, req_id: str, keys: Sequence[bytes], bounded_groups: Sequence[str],
                           save_class: SaveClass, *, timeout: float, token_ids: np.ndarray | None = None,
                           parent_key: bytes | None = None, retain_s: float | None = None) -> SaveTicket | Shed:
        return self.index.reserve_save(req_id, keys, bounded_groups, save_class, token_ids, parent_key, retain_s)

    async def commit_save(self, save_id: int, *, timeout: float) -> bool:
        return self.index.commit_save(save_id)

    def abort_save(self, save_id: int, writer_dead: bool = False) -> None:
        self.index.abort_save(save_id, writer_dead=writer_dead)

    def revoke_handoff(self, producer_req_id: str, consumed: bool = False) -> None:
        self.index.revoke_handoff(producer_req_id, consumed=consumed)

    async def stats(self) -> dict[str, int]:
        return self.index.stats()

    def close(self) -> None:
        self.up = False


class LocalCopier:
    """Runs copy orders on a worker thread (never on the event loop)."""

    def __init__(self, executor: CopyExecutor) -> None:
        self.executor = executor

    async def save(self, order: SaveOrder) -> int:
        return await asyncio.to_thread(self.executor.save, order)

    async def load(self, order: LoadOrder) -> int:
        return await asyncio.to_thread(self.executor.load, order)

    async def device_copy(self, copies: Sequence[SlotCopy], after_event: bytes | None = None) -> int:
        return await asyncio.to_thread(self.executor.device_copy, copies, after_event)

    def close(self) -> None:
        self.executor.close()
