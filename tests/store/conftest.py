"""A small model contract and store builders for the store's contract tests (store side; the tier and copier are
kvproc's real in-process ones, optionally behind a gate that holds a call until the test opens it)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any, Callable, Sequence

import torch

from kvproc import (
    ArenaId,
    GroupKind,
    GroupSpec,
    KvArena,
    KvSpec,
    RepackDirection,
    RequestKv,
    SealCursor,
    validate_layout,
)
from kvproc.store.kv_store import KvStore
from kvproc.store.local_tier import LocalCopier, LocalTier
from kvproc.store.types import StoreConfig
from kvproc.tiers.layout import HostLayout
from kvproc.workers.copy_exec import CopyExecutor

PAGE = 4
BLOCK_BYTES = 256
SLOT_BYTES = 128


class BytesModel:
    """Paged group `kv` (two arenas, like two layers) and optionally a bounded group `state` (two arenas)."""

    def __init__(self, num_blocks: int, *, bounded: bool = False, slots: int = 6) -> None:
        groups = [GroupSpec("kv", GroupKind.PAGED)]
        if bounded:
            groups.append(GroupSpec("state", GroupKind.BOUNDED))
        self._spec = KvSpec(PAGE, tuple(groups), model_id="tests-bytes-model")
        self._arenas = [("kv", KvArena(f"kv{i}", torch.zeros(num_blocks * BLOCK_BYTES, dtype=torch.uint8),
                                       num_blocks, BLOCK_BYTES, BLOCK_BYTES)) for i in range(2)]
        if bounded:
            self._arenas += [("state", KvArena(f"st{i}", torch.zeros(slots * SLOT_BYTES, dtype=torch.uint8),
                                               slots, SLOT_BYTES, SLOT_BYTES)) for i in range(2)]

    def spec(self) -> KvSpec:
        return self._spec

    def arenas(self, rank: int) -> list[tuple[str, KvArena]]:
        return list(self._arenas)

    def repack(self, group: str, direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor,
               arena: ArenaId) -> None:
        dst.copy_(src)

    def block(self, arena: int, bid: int) -> torch.Tensor:
        return self._arenas[arena][1].tensor[bid * BLOCK_BYTES : (bid + 1) * BLOCK_BYTES]

    def slot(self, arena: int, slot: int) -> torch.Tensor:
        return self._arenas[2 + arena][1].tensor[slot * SLOT_BYTES : (slot + 1) * SLOT_BYTES]


class Gate:
    """Holds gated calls until opened (a threading.Event, so tests on any thread can open it)."""

    def __init__(self, open_: bool = True) -> None:
        self.ev = threading.Event()
        if open_:
            self.ev.set()
        self.calls = 0

    async def passage(self) -> None:
        self.calls += 1
        while not self.ev.is_set():
            await asyncio.sleep(0.005)


class GatedTier(LocalTier):
    """kvproc's in-process tier with a gate on `query` (to hang it) and on `reserve_save`."""

    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.query_gate = Gate()
        self.save_gate = Gate()
        self.released: list[int] = []

    async def query(self, req_id: str, hashes: Sequence[bytes], *, timeout: float, parent: bytes | None = None) -> Any:
        await self.query_gate.passage()
        return await super().query(req_id, hashes, timeout=timeout, parent=parent)

    async def reserve_save(self, *a: Any, **k: Any) -> Any:
        await self.save_gate.passage()
        return await super().reserve_save(*a, **k)

    def release_lease(self, lease_id: int, consume_handoff: str | None = None) -> None:
        self.released.append(lease_id)
        super().release_lease(lease_id, consume_handoff)


class GatedCopier(LocalCopier):
    def __init__(self, *a: Any, **k: Any) -> None:
        super().__init__(*a, **k)
        self.load_gate = Gate()
        self.save_gate = Gate()
        self.fail_saves = False

    async def load(self, order: Any) -> int:
        await self.load_gate.passage()
        return await super().load(order)

    async def save(self, order: Any) -> int:
        await self.save_gate.passage()
        if self.fail_saves:
            raise RuntimeError("injected save failure")
        return await super().save(order)


def make_store(num_blocks: int = 32, *, bounded: bool = False, tier: bool = True, host_pages: int = 64,
               config: StoreConfig = StoreConfig(resolve_deadline_s=2.0),
               live_slots: int = 2) -> tuple[KvStore, BytesModel, GatedTier | None, GatedCopier | None]:
    model = BytesModel(num_blocks, bounded=bounded)
    layout = validate_layout(model.spec(), model.arenas(0))
    if not tier:
        return KvStore([layout], live_slots=live_slots, config=config), model, None, None
    hl = HostLayout.plan(layout, host_pages * 2 * BLOCK_BYTES + 64 * 8192, bounded_fraction=0.3)
    t = GatedTier(hl, [g.name for g in layout.spec.restorable_bounded_groups])
    c = GatedCopier(CopyExecutor(layout, t.host, hl))
    return KvStore([layout], live_slots=live_slots, tier=t, copiers=[c], config=config), model, t, c


def compute(store, model, rid, tokens, max_out=4, *, fill=True):
    """Admit with the resolved prefix, compute the rest, write random bytes into the new blocks; returns kv, cursor,
    and {page hash: (bytes of arena 0, bytes of arena 1)} for the pages this request computed."""
    pool = store.pools[0]
    prefix = store.resolve_prefix_sync(0, rid, tokens)
    kv = RequestKv(pool, rid, tokens, max_out)
    assert kv.try_admit(prefix.hold.num_blocks)
    store.execute_copies(0, kv.match_and_add_prefix(prefix.hold))
    start = kv.num_computed // PAGE
    kv.schedule(len(tokens) - kv.num_computed)
    written = {}
    for i, b in enumerate(kv.block_ids[start:], start):
        if fill:
            for a in range(2):
                model.block(a, b)[:] = torch.randint(0, 256, (256,), dtype=torch.uint8)
    kv.apply()
    for i, b in enumerate(kv.block_ids[: len(tokens) // PAGE]):
        written[kv.page_hashes[i]] = (model.block(0, b).clone(), model.block(1, b).clone())
    return kv, SealCursor.after_prefix(start), prefix, written


def churn(store):
    """Evict every unreferenced block of the device pool (and scribble over the arenas)."""
    pool = store.pools[0]
    with pool.lock:
        ids = pool.paged.allocate(pool.paged.available)
        pool.paged.release(ids)


class SharedMemoryModel(BytesModel):
    """The store fixtures' byte model with its arenas re-allocated through a ClusterStore."""

    def __init__(self, allocator) -> None:  # type: ignore[no-untyped-def]
        super().__init__(16, bounded=True)
        for i, (g, a) in enumerate(self._arenas):
            t = allocator(a.name, a.tensor.numel())
            self._arenas[i] = (g, type(a)(a.name, t, a.num_blocks, a.bytes_per_block, a.block_stride))


class RankShardModel:
    """Paged groups with an arena per rank (each rank's shard), in memory from `alloc` (a cluster's shared-memory
    allocator, or plain tensors)."""

    def __init__(self, spec: KvSpec, ranks: int,
                 alloc: Callable[[str, int], torch.Tensor] = lambda name, n: torch.zeros(n, dtype=torch.uint8),
                 num_blocks: int = 16, block_bytes: int = 64) -> None:
        self._spec, self.block_bytes = spec, block_bytes
        self._arenas = {r: [(g.name, KvArena(f"{g.name}_r{r}", alloc(f"{g.name}_r{r}", num_blocks * block_bytes),
                                             num_blocks, block_bytes, block_bytes)) for g in spec.groups]
                        for r in range(ranks)}

    def spec(self) -> KvSpec:
        return self._spec

    def arenas(self, rank: int) -> list[tuple[str, KvArena]]:
        return list(self._arenas[rank])

    def block(self, rank: int, b: int) -> torch.Tensor:
        """Rank `rank`'s block `b` of its first group's arena."""
        return self._arenas[rank][0][1].tensor[b * self.block_bytes : (b + 1) * self.block_bytes]
