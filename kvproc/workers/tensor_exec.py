"""The copy executor over a mover without host views (`torch` on any device, `cuda` on a GPU): the same orders, the
same checks and errors as `CopyExecutor`, over torch tensors instead of numpy views.

`CopyExecutor(layout, ..., mover=m)` returns this class when `m.host_views` is False (and for arenas on a GPU), so
callers never choose it. The arenas stay torch tensors (on their device); the host tier's regions are CPU tensors
over the host segment's mapping (`torch.from_numpy`: no copy; pinned on a GPU machine, `kvproc.ipc.pinning`).

Every order moves with one batched `mover.rows` call per arena: an order's pages (whatever runs they form: the mover
gathers and scatters by id, so there is no run planning), its bounded slots, a device copy's slots. A repacked arena
goes through the model's hook in batches of up to `GATHER_CHUNK_BYTES` of stored rows, each one gather by id into a
contiguous tensor on the arena's device (a `rows` call), one hook call, one scatter (a `rows` call): the hook always
sees tensors on the arena's device. Every id of every arena is checked before the first byte moves, so a bad order
refuses whole (`CopyError`, the same message as `CopyExecutor`'s). No thread pool: torch's kernels (or the GPU) do
the parallel work. Within one device copy the slots move as they were before it (the mover gathers first).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from kvproc.contract import ArenaId, ArenaLayout, GroupKind, RepackDirection
from kvproc.ipc.orders import BoundedCopy, LoadOrder, SaveOrder, SlotCopy
from kvproc.tiers import save_fence
from kvproc.tiers.layout import HostLayout
from kvproc.workers import copy_exec
from kvproc.workers.copy_exec import (
    LOAD_GIL_BYTES,
    SAVE_GIL_BYTES,
    CopyError,
    CopyExecutor,
    RepackFailures,
    RepackFn,
    call_hook,
    device_of,
    fence_row,
    host_region,
)
from kvproc.workers.movers import MoveError, Mover, mover_for
from kvproc.workers.torch_mover import ids_tensor

Job = Callable[[], int]


@dataclass(frozen=True)
class _TensorArena:
    name: str
    group: str
    paged: bool
    repack: bool  # the arena declares a stored layout: every block goes through the hook
    flat: torch.Tensor  # the device arena's bytes, 1-d, on its device (block i at i * stride)
    stride: int
    row: int  # bytes of one block on the device
    blocks: int
    host_flat: torch.Tensor | None  # the host region's bytes, 1-d, CPU (slot j at j * unit)
    unit: int  # bytes of one host slot (the stored layout's, for a repacked arena)
    slots: int
    ident: ArenaId  # what the hook is told


class TensorCopyExecutor(CopyExecutor):
    def __init__(self, layout: ArenaLayout, host: np.ndarray | None = None, host_layout: HostLayout | None = None,
                 repack: RepackFn | None = None, threads: int = 2, mover: Mover | None = None) -> None:
        del threads  # one `rows` call per arena: torch's kernels (or the GPU) parallelise it
        self.mover = mover if mover is not None else mover_for(device_of(layout))
        self.repack_fn = repack
        self.repack_failures = RepackFailures()
        self.fence_row = fence_row(host, host_layout)
        self._pool = None  # `CopyExecutor._run_jobs` then runs the jobs in order on this thread
        self.bytes_copied = 0
        arenas = []
        for group, a in layout.arenas:
            region = host_region(host, host_layout, a.name)
            unit = slots = 0
            if region is not None:
                assert host_layout is not None
                r = host_layout.region(a.name)
                unit, slots = r.unit_bytes, r.slots
            arenas.append(_TensorArena(
                a.name, group, layout.spec.group(group).kind is GroupKind.PAGED, a.repacked, a.byte_view(),
                a.block_stride, a.bytes_per_block, a.num_blocks,
                torch.from_numpy(region) if region is not None else None, unit, slots, layout.arena_id(a.name)))
        self.tensor_arenas = tuple(arenas)

    # -- orders ---------------------------------------------------------------------------------------------------
    def _save(self, order: SaveOrder) -> int:
        """As `CopyExecutor.save` (which runs this inside the order's engine fence, `engine_fence`: on the cuda
        mover every batch below then waits on the engine's event): the save's fence held for the whole write."""
        save_fence.claim(self.fence_row, order.fence, order.fence_token)
        try:
            return self._run(self._plan_tensors(order.device_blocks, order.host_slots, order.bounded, True))
        finally:
            save_fence.release(self.fence_row, order.fence, order.fence_token)

    def load(self, order: LoadOrder) -> int:
        return self._run(self._plan_tensors(order.device_blocks, order.host_slots, order.bounded, False))

    def _device_copy(self, copies: Sequence[SlotCopy]) -> int:
        jobs: list[Job] = []
        for a in self.tensor_arenas:
            mine = [c for c in copies if c.group == a.group]
            if not mine:
                continue
            src, dst = [c.src_slot for c in mine], [c.dst_slot for c in mine]
            if min(src + dst) < 0 or max(src + dst) >= a.blocks:
                raise CopyError(f"arena {a.name}: ids out of range (slots < {a.blocks})")
            jobs.append(self._batch(a.flat, a.stride, dst, a.flat, a.stride, src, a.row, LOAD_GIL_BYTES))
        if not jobs:
            raise CopyError(f"no arena for groups {sorted({c.group for c in copies})}")
        return self._run(jobs)

    def _engine_arenas(self) -> dict[str, tuple[int, int, int]]:
        """Cross-memory attach reaches host memory only: CPU arenas by address; a GPU arena is refused."""
        out = {}
        for a in self.tensor_arenas:
            if a.flat.device.type != "cpu":
                raise CopyError(f"EngineMove: arena {a.name!r} is on {a.flat.device}: cross-memory attach moves host"
                                " memory only (a GPU engine's arenas are opened by CUDA IPC at attach)")
            out[a.name] = (a.blocks, a.stride, a.flat.data_ptr())
        return out

    # -- planning: every check first, then the jobs -----------------------------------------------------------------
    def _plan_tensors(self, device: Sequence[int], host: Sequence[int], bounded: Sequence[BoundedCopy],
                      to_host: bool) -> list[Job]:
        if len(device) != len(host):
            raise CopyError(f"{len(device)} device blocks against {len(host)} host slots")
        jobs: list[Job] = []
        pages = (ids_tensor(device), ids_tensor(host)) if len(device) else None
        bounds = (min(device), max(device), min(host), max(host)) if len(device) else None
        for a in self.tensor_arenas:
            if a.host_flat is None:
                continue
            if a.paged:
                if pages is None or bounds is None:
                    continue  # no pages in this order
                self._check(a, *bounds)
                jobs += self._moves(a, *pages, to_host)
                continue
            mine = [b for b in bounded if b.group == a.group]
            if mine:
                d, h = [b.device_slot for b in mine], [b.host_slot for b in mine]
                self._check(a, min(d), max(d), min(h), max(h))
                jobs += self._moves(a, ids_tensor(d), ids_tensor(h), to_host)
        return jobs

    @staticmethod
    def _check(a: _TensorArena, dmin: int, dmax: int, hmin: int, hmax: int) -> None:  # type: ignore[override]
        if dmin < 0 or dmax >= a.blocks or hmin < 0 or hmax >= a.slots:
            raise CopyError(f"arena {a.name}: ids out of range (device < {a.blocks}, host < {a.slots})")

    def _moves(self, a: _TensorArena, d: torch.Tensor, h: torch.Tensor, to_host: bool) -> list[Job]:
        """One `rows` call for the arena's ids, or its repack batches."""
        assert a.host_flat is not None
        if a.repack:
            return self._repack_batches(a, d, h, to_host)
        if to_host:
            return [self._batch(a.host_flat, a.unit, h, a.flat, a.stride, d, a.row, SAVE_GIL_BYTES)]
        return [self._batch(a.flat, a.stride, d, a.host_flat, a.unit, h, a.row, LOAD_GIL_BYTES)]

    def _batch(self, dst: torch.Tensor, dst_stride: int, dst_ids: Sequence[int] | torch.Tensor, src: torch.Tensor,
              src_stride: int, src_ids: Sequence[int] | torch.Tensor, row: int, gil: int) -> Job:
        mover = self.mover

        def run() -> int:
            try:  # the torch movers take an int64 tensor of ids as well (`ids_tensor`): no list is rebuilt
                return mover.rows(dst, dst_stride, cast(Sequence[int], dst_ids), src, src_stride,
                                  cast(Sequence[int], src_ids), row, gil)
            except MoveError as e:  # checked by the plan already: a stale layout, say, not a bad order
                raise CopyError(str(e)) from None

        return run

    def _repack_batches(self, a: _TensorArena, d: torch.Tensor, h: torch.Tensor, to_host: bool) -> list[Job]:
        fn = self.repack_fn
        if fn is None:
            raise CopyError(f"arena {a.name} declares a stored layout but the store has no repack hook")
        per = max(1, copy_exec.GATHER_CHUNK_BYTES // max(1, a.unit))
        return [self._repack_batch(fn, a, d[i : i + per], h[i : i + per], to_host) for i in range(0, d.numel(), per)]

    def _repack_batch(self, fn: RepackFn, a: _TensorArena, d: torch.Tensor, h: torch.Tensor, to_host: bool) -> Job:
        """Gather by id into a contiguous tensor on the arena's device, one hook call, scatter by id."""
        host_flat = a.host_flat
        assert host_flat is not None
        k = int(d.numel())
        dev = a.flat.device
        every = torch.arange(k, dtype=torch.int64)
        direction = RepackDirection.SAVE if to_host else RepackDirection.LOAD
        src_row, dst_row = (a.row, a.unit) if to_host else (a.unit, a.row)

        def run() -> int:
            staged = torch.empty(k * src_row, dtype=torch.uint8, device=dev)
            out = torch.empty((k, dst_row), dtype=torch.uint8, device=dev)
            if to_host:
                self._batch(staged, src_row, every, a.flat, a.stride, d, a.row, SAVE_GIL_BYTES)()
                call_hook(fn, a.group, direction, staged.view(k, src_row), out, a.ident)
                self._batch(host_flat, a.unit, h, out.view(-1), dst_row, every, a.unit, SAVE_GIL_BYTES)()
            else:
                self._batch(staged, src_row, every, host_flat, a.unit, h, a.unit, LOAD_GIL_BYTES)()
                call_hook(fn, a.group, direction, staged.view(k, src_row), out, a.ident)
                self._batch(a.flat, a.stride, d, out.view(-1), dst_row, every, a.row, LOAD_GIL_BYTES)()
            return k * a.row

        return run
