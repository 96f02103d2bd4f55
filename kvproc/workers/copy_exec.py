"""The copy path: move blocks between device arenas and the host arena, coalesced and vectorised.

Pairs (device id, host slot) are split into runs where both sides are consecutive (one numpy diff), and each run is
one slice copy per arena: contiguous host units and, when the arena packs its blocks (stride == bytes), contiguous
device bytes, i.e. one memcpy. There is no per-block Python loop. Large batches are split across two threads (numpy
copies release the GIL), which is what reaches the memory-bandwidth limit on this class of machine.

Where the model's stored layout differs (`repack`), each run goes through the hook in (run, bytes) row batches.

CPU-only here: device arenas are shared-memory tensors. # NEEDS-GPU-CHECK: a CUDA build would issue
`dst.copy_(src, non_blocking=True)` on a dedicated stream after the step's event; that path is not written yet.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from kvproc.contract import ArenaLayout, GroupKind, RepackDirection
from kvproc.tiers.layout import HostLayout
from kvproc.workers.orders import LoadOrder, SaveOrder, SlotCopy

RepackFn = Callable[[str, RepackDirection, torch.Tensor, torch.Tensor], None]
PARALLEL_BYTES = 8 << 20  # below this, a second thread costs more than it saves


class CopyError(RuntimeError):
    """A copy order could not be executed (bad ids, stale layout); nothing was half-applied silently."""


@dataclass(frozen=True)
class _Arena:
    name: str
    group: str
    paged: bool
    rows: np.ndarray  # (num_blocks, bytes_per_block) strided view over the device arena
    host: np.ndarray | None  # (slots, stored_bytes) view of this arena's host region
    repack: bool  # stored layout differs from the execution layout


def runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) of maximal runs where both sides advance by one."""
    if src.size == 0:
        return []
    brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], brk))
    lens = np.diff(np.concatenate((starts, [src.size])))
    return list(zip(src[starts].tolist(), dst[starts].tolist(), lens.tolist()))


class CopyExecutor:
    def __init__(
        self,
        layout: ArenaLayout,
        host: np.ndarray | None = None,
        host_layout: HostLayout | None = None,
        repack: RepackFn | None = None,
        threads: int = 2,
    ) -> None:
        self.repack_fn = repack
        arenas = []
        for group, a in layout.arenas:
            base = a.byte_view().numpy()
            rows = np.lib.stride_tricks.as_strided(base, (a.num_blocks, a.bytes_per_block), (a.block_stride, 1))
            hview = None
            if host is not None and host_layout is not None:
                try:
                    r = host_layout.region(a.name)
                except KeyError:
                    r = None
                if r is not None:
                    hview = host[r.offset : r.offset + r.slots * r.unit_bytes].reshape(r.slots, r.unit_bytes)
            kind = layout.spec.group(group).kind
            arenas.append(_Arena(a.name, group, kind is GroupKind.PAGED, rows, hview, a.stored_bytes != a.bytes_per_block))
        self.arenas = tuple(arenas)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvproc-copy") if threads > 1 else None
        self.bytes_copied = 0

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # -- orders ---------------------------------------------------------------------------------------------------
    def save(self, order: SaveOrder) -> int:
        jobs = self._plan(order.device_blocks, order.host_slots, [(b.group, b.device_slot, b.host_slot)
                                                                   for b in order.bounded], to_host=True)
        return self._run(jobs)

    def load(self, order: LoadOrder) -> int:
        jobs = self._plan(order.device_blocks, order.host_slots, [(b.group, b.device_slot, b.host_slot)
                                                                   for b in order.bounded], to_host=False)
        return self._run(jobs)

    def device_copy(self, copies: Sequence[SlotCopy]) -> int:
        jobs: list[Callable[[], int]] = []
        for c in copies:
            for a in self.arenas:
                if a.group == c.group:
                    jobs.append(_slice_copy(a.rows, c.dst_slot, a.rows, c.src_slot, 1))
        if not jobs:
            raise CopyError(f"no arena for groups {sorted({c.group for c in copies})}")
        return self._run(jobs)

    # -- planning -------------------------------------------------------------------------------------------------
    def _plan(self, device: Sequence[int], host: Sequence[int], bounded: Sequence[tuple[str, int, int]],
              to_host: bool) -> list[Callable[[], int]]:
        if len(device) != len(host):
            raise CopyError(f"{len(device)} device blocks against {len(host)} host slots")
        d = np.asarray(device, dtype=np.int64)
        h = np.asarray(host, dtype=np.int64)
        jobs: list[Callable[[], int]] = []
        page_runs = runs(d, h)
        for a in self.arenas:
            if a.host is None:
                continue
            if a.paged:
                self._check(a, d, h)
                for d0, h0, k in page_runs:
                    jobs.append(self._job(a, d0, h0, k, to_host))
            else:
                for group, dslot, hslot in bounded:
                    if group == a.group:
                        self._check(a, np.asarray([dslot]), np.asarray([hslot]))
                        jobs.append(self._job(a, dslot, hslot, 1, to_host))
        return jobs

    @staticmethod
    def _check(a: _Arena, d: np.ndarray, h: np.ndarray) -> None:
        assert a.host is not None
        if d.size and (d.min() < 0 or d.max() >= a.rows.shape[0] or h.min() < 0 or h.max() >= a.host.shape[0]):
            raise CopyError(f"arena {a.name}: ids out of range (device < {a.rows.shape[0]}, host < {a.host.shape[0]})")

    def _job(self, a: _Arena, d0: int, h0: int, k: int, to_host: bool) -> Callable[[], int]:
        assert a.host is not None
        if not a.repack:
            if to_host:
                return _slice_copy(a.host, h0, a.rows, d0, k)
            return _slice_copy(a.rows, d0, a.host, h0, k)
        fn = self.repack_fn
        if fn is None:
            raise CopyError(f"arena {a.name} declares a stored layout but the store has no repack hook")
        host_rows, dev_rows, group = a.host, a.rows, a.group

        def run() -> int:
            if to_host:
                src = torch.from_numpy(np.ascontiguousarray(dev_rows[d0 : d0 + k]))
                dst = torch.empty((k, host_rows.shape[1]), dtype=torch.uint8)
                fn(group, RepackDirection.SAVE, src, dst)
                host_rows[h0 : h0 + k] = dst.numpy()
            else:
                src = torch.from_numpy(np.ascontiguousarray(host_rows[h0 : h0 + k]))
                dst = torch.empty((k, dev_rows.shape[1]), dtype=torch.uint8)
                fn(group, RepackDirection.LOAD, src, dst)
                dev_rows[d0 : d0 + k] = dst.numpy()
            return k * dev_rows.shape[1]

        return run

    def _run(self, jobs: list[Callable[[], int]]) -> int:
        total = sum(j.nbytes for j in jobs if isinstance(j, _SliceCopy))
        if self._pool is None or total < PARALLEL_BYTES:
            n = sum(j() for j in jobs)
        else:
            # Split the byte volume in two halves (cutting one big run if needed) and copy them on two threads.
            first, second = _halve(jobs, total)
            fut = self._pool.submit(lambda: sum(j() for j in second))
            n = sum(j() for j in first) + fut.result()
        self.bytes_copied += n
        return n


@dataclass(frozen=True)
class _SliceCopy:
    """dst[d0:d0+k] = src[s0:s0+k] over (rows, bytes) views: one memcpy when both sides are contiguous."""

    dst: np.ndarray
    d0: int
    src: np.ndarray
    s0: int
    k: int

    @property
    def nbytes(self) -> int:
        return self.k * self.src.shape[1]

    def __call__(self) -> int:
        np.copyto(self.dst[self.d0 : self.d0 + self.k], self.src[self.s0 : self.s0 + self.k])
        return self.nbytes


def _slice_copy(dst: np.ndarray, d0: int, src: np.ndarray, s0: int, k: int) -> _SliceCopy:
    return _SliceCopy(dst, d0, src, s0, k)


def _halve(jobs: list[Callable[[], int]], total: int) -> tuple[list[Callable[[], int]], list[Callable[[], int]]]:
    first: list[Callable[[], int]] = []
    second: list[Callable[[], int]] = []
    acc = 0
    for j in jobs:
        nb = j.nbytes if isinstance(j, _SliceCopy) else 0
        if acc >= total // 2:
            second.append(j)
        elif isinstance(j, _SliceCopy) and acc + nb > total // 2 and j.k > 1:
            cut = max(1, min(j.k - 1, (total // 2 - acc) // j.src.shape[1]))
            first.append(_SliceCopy(j.dst, j.d0, j.src, j.s0, cut))
            second.append(_SliceCopy(j.dst, j.d0 + cut, j.src, j.s0 + cut, j.k - cut))
            acc = total
        else:
            first.append(j)
            acc += nb
    return first, second
