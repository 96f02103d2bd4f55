"""The copy path: move blocks between device arenas and the host arena, coalesced and vectorised.

Where `kvproc.native._native` is built, an arena whose stored layout is its execution layout moves an order's blocks in one
C call (`copy_rows`: every id checked first, then one memmove per run where both sides are consecutive and packed,
else one per block): no plan is built in Python at all (a 1-block load of two arenas: ~3 us in all, against ~16 us
through the plan and numpy below). What follows is that planned path: repacked arenas, big orders, and the build
without the compiled module.

Pairs (device id, host slot) are split into runs where both sides are consecutive: one pass in C where
`kvproc.native._native` is built (a 64-block order plans in ~3 us), else a Python loop for short orders and numpy for long
ones (~80 us of fixed per-call cost at 64 blocks: more than copying 256 KiB). A run of at
least `LONG_RUN` blocks is one slice copy per arena: contiguous host units and, when the arena packs its blocks
(stride == bytes), contiguous device bytes, i.e. one memcpy. In an arena of small blocks (< `GATHER_MAX_BLOCK_BYTES`)
the blocks of all shorter runs (scattered ids) move in one fancy-index copy (`dst[ids] = src[slots]`, gather +
scatter in C): there a Python call per block would cost more than the block's bytes. Bigger blocks keep one slice
copy each, since the gather's second pass over the bytes would cost more than the call (`kvproc bench copy`). There
is no per-block Python loop. Large batches are split across two threads (numpy copies and big `copy_rows` calls
release the GIL), which is what reaches the memory-bandwidth limit on this class of machine.

Where the model's stored layout differs (`repack`), an order's blocks of that arena go through the hook in one
(blocks, bytes) batch per 4 MiB, gathered by id and scattered back, whatever runs they form (`_RepackCopy`).

Every byte moves through the executor's mover (`kvproc/workers/movers.py`, chosen there from the arenas' device):
the `copy_rows` calls above are its `rows`, and the planned numpy paths are the `memmove` mover's own (they need its
numpy views of this process's memory). An engine's private memory moves through the `cma` mover (`engine_move`).
A mover without host views (`torch`, and `cuda` on a GPU) gets the executor in `kvproc/workers/tensor_exec.py`
(`CopyExecutor(...)` builds that one for such a mover): the arenas stay torch tensors and every order is one batched
`rows` call per arena (per chunk through a repack hook), never a call per block. The paths above are untouched by it.
"""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import structlog
import torch

from kvproc.contract import ArenaId, ArenaLayout, GroupKind, RepackDirection
from kvproc.ipc.orders import LoadOrder, SaveOrder, SlotCopy
from kvproc.native import NATIVE
from kvproc.tiers import save_fence
from kvproc.tiers.layout import HostLayout
from kvproc.tiers.slot_table import FENCE, ROW_BYTES
from kvproc.workers.engine_fence import engine_fence
from kvproc.workers.movers import MoveError, Mover, RemoteMemory, mover_for

RepackFn = Callable[[str, RepackDirection, torch.Tensor, torch.Tensor, ArenaId], None]
PARALLEL_BYTES = 8 << 20  # below this, a second thread costs more than it saves
# When a `copy_rows` call lets go of the GIL. A save runs on a worker's handler thread, in the background: always, so
# the socket thread keeps answering (a load waits on it). A load runs on the socket thread and its caller waits for the
# reply: only when big, since taking the GIL back can wait out another thread's switch interval (5 ms).
SAVE_GIL_BYTES = 0
LOAD_GIL_BYTES = 1 << 20


log = structlog.get_logger("kvproc.copy")


class CopyError(RuntimeError):
    """A copy order could not be executed (bad ids, stale layout); nothing was half-applied silently."""


class RepackError(CopyError):
    """The model's repack hook raised for a batch of an arena's blocks: the order failed (a load is then no hit,
    never wrong KV). `arena`, `direction` and the hook's traceback say where."""

    def __init__(self, arena: ArenaId, direction: RepackDirection, cause: BaseException) -> None:
        super().__init__(f"repack hook failed on {direction.value} of arena {arena.name!r}: "
                         f"{type(cause).__name__}: {cause}")
        self.arena, self.direction = arena, direction
        self.trace = "".join(traceback.format_exception(cause))


class RepackFailures:
    """Failed hook calls counted by arena (`repack_failed.<arena>`), each distinct cause logged once as an error with
    the hook's traceback: a broken hook is loud, not a stream of silent misses, and not a log flood either."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.by_arena: Counter[str] = Counter()
        self._seen: set[tuple[str, str, str, str]] = set()

    def record(self, err: RepackError) -> None:
        cause = (err.arena.name, err.direction.value, err.trace.splitlines()[-1] if err.trace else "", "")
        with self._lock:
            self.by_arena[err.arena.name] += 1
            first = cause not in self._seen
            self._seen.add(cause)
        if first:
            log.error("repack_hook_failed", arena=err.arena.name, arena_index=err.arena.index,
                      direction=err.direction.value, error=str(err), traceback=err.trace)


def call_hook(fn: "RepackFn", group: str, direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor,
              ident: ArenaId) -> None:
    """One hook call; whatever it raises becomes a `RepackError` naming the arena and direction."""
    try:
        fn(group, direction, src, dst, ident)
    except Exception as e:  # noqa: BLE001 - a model's hook may raise anything; the order fails with it
        raise RepackError(ident, direction, e) from e


@dataclass(frozen=True)
class _Arena:
    name: str
    group: str
    paged: bool
    rows: np.ndarray  # (num_blocks, bytes_per_block) strided view over the device arena
    host: np.ndarray | None  # (slots, stored_bytes) view of this arena's host region
    repack: bool  # the arena declares a stored layout: every block goes through the hook
    flat: np.ndarray  # the device arena's bytes, 1-d (what `copy_rows` addresses: block i at i * stride)
    stride: int  # device bytes from one block to the next
    host_flat: np.ndarray | None  # the host region's bytes, 1-d (slot j at j * stored bytes)
    ident: ArenaId  # what the hook is told


SMALL_ORDER = 32  # blocks: below this, planning in plain Python beats numpy's fixed per-call cost (see `runs`)


def runs(src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, length) of maximal runs where both sides advance by one.

    One C pass where `kvproc.native._native` is built. Without it: up to `SMALL_ORDER` pairs one pass over two short lists
    (~3 us for 32); numpy's version costs ~8 calls at 1-3 us each whatever the size, so it takes over only where its
    per-element speed pays (a resolve's typical load is a few blocks; `kvproc bench copy` / `bench ipc` measure both
    ends)."""
    n = len(src)
    if n == 0:
        return []
    if NATIVE is not None:
        return NATIVE.copy_plan(src, dst, 1)[0]
    if n <= SMALL_ORDER:
        s = src.tolist() if isinstance(src, np.ndarray) else list(src)
        d = dst.tolist() if isinstance(dst, np.ndarray) else list(dst)
        out = []
        s0, d0, k = s[0], d[0], 1
        for i in range(1, n):
            if s[i] == s0 + k and d[i] == d0 + k:
                k += 1
            else:
                out.append((s0, d0, k))
                s0, d0, k = s[i], d[i], 1
        out.append((s0, d0, k))
        return out
    return _runs_numpy(src, dst)


def _run_arrays(src: Sequence[int] | np.ndarray,
                dst: Sequence[int] | np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(src ids, dst ids, run starts, run lengths) as arrays: the one vectorised run finder (`runs`, `split_runs`)."""
    sa = np.asarray(src, dtype=np.int64)
    da = np.asarray(dst, dtype=np.int64)
    starts = np.concatenate(([0], np.flatnonzero((np.diff(sa) != 1) | (np.diff(da) != 1)) + 1))
    lens = np.diff(np.concatenate((starts, [sa.size])))
    return sa, da, starts, lens


def _runs_numpy(src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray) -> list[tuple[int, int, int]]:
    if len(src) == 0:
        return []
    sa, da, starts, lens = _run_arrays(src, dst)
    return list(zip(sa[starts].tolist(), da[starts].tolist(), lens.tolist()))


LONG_RUN = 4  # blocks: a run at least this long is one slice copy; shorter runs' blocks go into one gather
# Below this block size a scattered block is cheaper in a gather (two C passes over its bytes) than in its own slice
# copy (~3-5 us of Python and numpy call overhead per block). Measured (`kvproc bench copy`, 128 MiB batches, same
# run): 4 KiB 0.44-0.54x memcpy gathered vs 0.04-0.05x per block; 64 KiB 0.70-0.77x vs 0.40-0.45x; 128 KiB 0.65-0.70x
# vs 0.64-0.91x; 256 KiB 0.71-0.74x vs 1.03-1.07x; 1 MiB 0.7x vs 1.2-1.3x.
GATHER_MAX_BLOCK_BYTES = 128 << 10


Bounds = tuple[int, int, int, int]  # (src min, src max, dst min, dst max)


def plan_runs(src: Sequence[int], dst: Sequence[int], long_run: int = LONG_RUN
              ) -> tuple[list[tuple[int, int, int]], np.ndarray, np.ndarray, Bounds | None]:
    """`split_runs` with `long_run` as the threshold, plus the ids' bounds (None for an empty order): what a copy
    plan needs, in one C pass where `kvproc.native._native` is built. `long_run=1` returns every run as long."""
    if NATIVE is not None:
        long_runs, gs, gd, bounds = NATIVE.copy_plan(src, dst, long_run)
        return (long_runs, np.asarray(gs, dtype=np.int64) if gs else _NO_IDS,
                np.asarray(gd, dtype=np.int64) if gd else _NO_IDS, bounds)
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source ids against {len(dst)} destination ids")
    bounds = (*_bounds(src), *_bounds(dst)) if len(src) else None
    if long_run <= 1:
        return runs(src, dst), _NO_IDS, _NO_IDS, bounds
    return (*split_runs(src, dst, long_run), bounds)


_NO_IDS = np.zeros(0, dtype=np.int64)


def split_runs(src: Sequence[int], dst: Sequence[int], long_run: int = LONG_RUN
               ) -> tuple[list[tuple[int, int, int]], np.ndarray, np.ndarray]:
    """(long runs as (src_start, dst_start, length), src ids and dst ids of every block in a shorter run): the
    pure-Python form (`plan_runs` uses C where it is built)."""
    n = len(src)
    if n <= SMALL_ORDER:
        long_runs: list[tuple[int, int, int]] = []
        gs: list[int] = []
        gd: list[int] = []
        for s0, d0, k in runs(src, dst):
            if k >= long_run:
                long_runs.append((s0, d0, k))
            else:
                gs.extend(range(s0, s0 + k))
                gd.extend(range(d0, d0 + k))
        return long_runs, np.asarray(gs, dtype=np.int64), np.asarray(gd, dtype=np.int64)
    sa, da, starts, lens = _run_arrays(src, dst)
    long = lens >= long_run
    in_short = np.repeat(~long, lens)  # per block: does it belong to a short run
    ls = starts[long]
    return (list(zip(sa[ls].tolist(), da[ls].tolist(), lens[long].tolist())), sa[in_short], da[in_short])


def _bounds(ids: Sequence[int]) -> tuple[int, int]:
    """(min, max) of a non-empty id list: builtins on a short list, one numpy reduction pair on a long one."""
    if len(ids) <= SMALL_ORDER:
        return min(ids), max(ids)
    a = np.asarray(ids, dtype=np.int64)
    return int(a.min()), int(a.max())


def fence_row(host: np.ndarray | None, host_layout: HostLayout | None) -> np.ndarray | None:
    """The host tier's save-fence words (the slot table's FENCE row), where this host arena has a table."""
    if host is None or host_layout is None or host_layout.slot_table_offset < 0:
        return None
    off = host_layout.slot_table_offset + FENCE * host_layout.page_slots * ROW_BYTES
    return host[off : off + host_layout.page_slots * ROW_BYTES].view(np.int64)


def host_region(host: np.ndarray | None, host_layout: HostLayout | None, arena: str) -> np.ndarray | None:
    """An arena's host region as flat bytes (slot j at j * unit bytes), or None (no host tier, or no region)."""
    if host is None or host_layout is None:
        return None
    try:
        r = host_layout.region(arena)
    except KeyError:
        return None
    return host[r.offset : r.offset + r.slots * r.unit_bytes]


class CopyExecutor:
    # Move non-repacked pages with `kvproc.native._native.copy_rows` where it is built; False plans them for numpy (long runs
    # as slices, the rest in one gather): the A/B knob behind `kvproc bench copy`'s "numpy path" rows.
    use_copy_rows = True
    # A repacked arena's blocks go through the hook in batches (`_repack_copies`); False: one call per run, the path
    # before (the A/B knob behind `bench/repack_copy.py`).
    batch_repack = True

    def __new__(  # noqa: PYI034 - returns the subclass for a mover without host views, not Self
        cls, layout: ArenaLayout, host: np.ndarray | None = None, host_layout: HostLayout | None = None,
        repack: RepackFn | None = None, threads: int = 2, mover: Mover | None = None,
    ) -> CopyExecutor:
        """A mover without host views (torch tensors, maybe on a GPU) gets `TensorCopyExecutor`, the same orders
        over torch tensors; every other mover this class, whose planned paths need numpy views."""
        views = mover.host_views if mover is not None else device_of(layout) == "cpu"  # cpu: memmove's views
        if cls is CopyExecutor and not views:
            from kvproc.workers.tensor_exec import TensorCopyExecutor  # lazy: it subclasses this one

            return super().__new__(TensorCopyExecutor)
        return super().__new__(cls)

    def __init__(
        self,
        layout: ArenaLayout,
        host: np.ndarray | None = None,
        host_layout: HostLayout | None = None,
        repack: RepackFn | None = None,
        threads: int = 2,
        mover: Mover | None = None,
    ) -> None:
        self.mover = mover if mover is not None else mover_for(device_of(layout))
        self.repack_fn = repack
        self.repack_failures = RepackFailures()
        self.fence_row = fence_row(host, host_layout)
        arenas = []
        for group, a in layout.arenas:
            base = a.byte_view().numpy()
            rows = np.lib.stride_tricks.as_strided(base, (a.num_blocks, a.bytes_per_block), (a.block_stride, 1))
            hview = None
            hflat = host_region(host, host_layout, a.name)
            if hflat is not None:
                assert host_layout is not None
                r = host_layout.region(a.name)
                hview = hflat.reshape(r.slots, r.unit_bytes)
            kind = layout.spec.group(group).kind
            arenas.append(_Arena(a.name, group, kind is GroupKind.PAGED, rows, hview, a.repacked, base,
                                 a.block_stride, hflat, layout.arena_id(a.name)))
        self.arenas = tuple(arenas)
        # Whether any paged arena moves short runs in a gather (else every plan is one copy per run).
        self._any_gather = any(a.host is not None and a.paged and not self._per_run(a) for a in self.arenas)
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="kvproc-copy") if threads > 1 else None
        self.bytes_copied = 0
        # The direct path (`_direct`): when every paged arena with a host region stores its execution layout, a
        # page-only order below the two-thread size is a `copy_rows` call per arena, with no job objects at all (a
        # 1-block load: ~3 us instead of ~16). Per arena: (device bytes, stride, host bytes, slot bytes, row bytes).
        hosted = [ar for ar in self.arenas if ar.paged and ar.host is not None and ar.host_flat is not None]
        per_arena: list[tuple[np.ndarray, int, np.ndarray, int, int, int, int]] = []
        for ar in hosted:
            assert ar.host is not None and ar.host_flat is not None
            per_arena.append((ar.flat, ar.stride, ar.host_flat, ar.host.shape[1], ar.rows.shape[1], ar.rows.shape[0],
                              ar.host.shape[0]))
        self._rows = tuple(r[:5] for r in per_arena)
        self._direct_limits: tuple[int, int] | None = None  # (device blocks, host slots) every arena has
        if NATIVE is not None and per_arena and not any(ar.repack for ar in hosted):
            self._direct_limits = (min(r[5] for r in per_arena), min(r[6] for r in per_arena))
        # When every arena's buffers end exactly at those limits, `copy_rows` checking the first arena's call (all ids,
        # before any byte moves) is the check for all of them: the order's ids are not walked again in Python.
        self._first_call_checks = self._direct_limits is not None and all(
            (len(flat) - row) // stride + 1 == self._direct_limits[0]
            and (len(hflat) - row) // unit + 1 == self._direct_limits[1]
            for flat, stride, hflat, unit, row in self._rows)
        self._row_bytes = sum(r[4] for r in self._rows)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # -- orders ---------------------------------------------------------------------------------------------------
    def save(self, order: SaveOrder) -> int:
        """Copy a save's pages and bounded slots into the host tier, holding the save's fence for the whole write:
        a save the tier has given back (`FenceRevoked`) writes nothing (`kvproc/tiers/save_fence.py`). With an engine
        event (`after_event`), the whole order runs after it on the GPU (the cuda mover), or is refused before anything
        is claimed where the mover moves host memory (`kvproc/workers/engine_fence.py`)."""
        if order.after_event is None:  # no fence: not even the context manager
            return self._save(order)
        with engine_fence(self.mover, order.after_event, True, f"save order of request {order.req_id!r}"):
            return self._save(order)

    def _save(self, order: SaveOrder) -> int:
        save_fence.claim(self.fence_row, order.fence, order.fence_token)
        try:
            if not order.bounded and (n := self._direct(order.device_blocks, order.host_slots, True)) is not None:
                return n
            jobs = self._plan(order.device_blocks, order.host_slots, [(b.group, b.device_slot, b.host_slot)
                                                                       for b in order.bounded], to_host=True)
            return self._run(jobs)
        finally:
            save_fence.release(self.fence_row, order.fence, order.fence_token)

    def load(self, order: LoadOrder) -> int:
        if not order.bounded and (n := self._direct(order.device_blocks, order.host_slots, False)) is not None:
            return n
        jobs = self._plan(order.device_blocks, order.host_slots, [(b.group, b.device_slot, b.host_slot)
                                                                   for b in order.bounded], to_host=False)
        return self._run(jobs)

    def device_copy(self, copies: Sequence[SlotCopy], after_event: bytes | None = None) -> int:
        """Bounded slot copies (seal-by-copy, restore) within the device arenas; `after_event` as a save's."""
        if after_event is None:
            return self._device_copy(copies)
        with engine_fence(self.mover, after_event, False, f"device copy of {len(copies)} slot(s)"):
            return self._device_copy(copies)

    def _device_copy(self, copies: Sequence[SlotCopy]) -> int:
        jobs: list[Callable[[], int]] = []
        for c in copies:
            for a in self.arenas:
                if a.group == c.group:
                    if not (0 <= c.src_slot < a.rows.shape[0] and 0 <= c.dst_slot < a.rows.shape[0]):
                        raise CopyError(f"arena {a.name}: ids out of range (slots < {a.rows.shape[0]})")
                    jobs.append(_slice_copy(a.rows, c.dst_slot, a.rows, c.src_slot, 1))
        if not jobs:
            raise CopyError(f"no arena for groups {sorted({c.group for c in copies})}")
        return self._run(jobs)

    def engine_move(self, pid: int, to_engine: bool, arenas: Sequence[str], engine_bases: Sequence[int],
                    engine_stride: int, block_bytes: int, engine_ids: Sequence[int], arena_ids: Sequence[int]) -> int:
        """Blocks between process `pid`'s private memory (block `engine_ids[i]` of layer l at `engine_bases[l] + id *
        engine_stride`) and block `arena_ids[i]` of `arenas[l]`, through the cross-memory mover (`mover_for`)."""
        if len(arenas) != len(engine_bases) or len(engine_ids) != len(arena_ids):
            raise CopyError("EngineMove: arenas/engine_bases or engine_ids/arena_ids differ in length")
        by_name = self._engine_arenas()
        try:
            mover = mover_for(engine_pid=pid)
        except (MoveError, OSError) as e:
            raise CopyError(f"EngineMove: {e}") from None
        n = 0
        for name, remote in zip(arenas, engine_bases):
            a = by_name.get(name)
            if a is None:
                raise CopyError(f"EngineMove: no arena {name!r} attached")
            blocks, astride, here = a
            if block_bytes > astride or any(not 0 <= b < blocks for b in arena_ids):
                raise CopyError(f"EngineMove: arena {name!r} has {blocks} blocks of {astride} B")
            there = RemoteMemory(pid, remote)
            stride = engine_stride or block_bytes
            try:
                n += mover.rows(there, stride, engine_ids, here, astride, arena_ids, block_bytes, 0) if to_engine \
                    else mover.rows(here, astride, arena_ids, there, stride, engine_ids, block_bytes, 0)
            except MoveError as e:
                raise CopyError(f"EngineMove: {e}") from None
        return n

    def _engine_arenas(self) -> dict[str, tuple[int, int, int]]:
        """Arena name -> (blocks, stride, address of block 0 in this process): what a cross-memory move addresses."""
        return {a.name: (a.rows.shape[0], a.stride, a.flat.ctypes.data) for a in self.arenas}

    def mover_name(self, kind: str) -> str:
        """Which mover moved an order of this kind ("save", "load", "device", "engine"): what the worker counts."""
        return "cma" if kind == "engine" else self.mover.name

    def _direct(self, device: Sequence[int], host: Sequence[int], to_host: bool) -> int | None:
        """A page-only order in one `copy_rows` call per arena (see `__init__`); None where it does not apply (no
        compiled module, a repacked arena, a copy big enough for two threads): the planned path takes it."""
        limits = self._direct_limits
        if limits is None or not self.use_copy_rows or len(device) * self._row_bytes >= PARALLEL_BYTES:
            return None
        if len(device) != len(host):
            raise CopyError(f"{len(device)} device blocks against {len(host)} host slots")
        if not device:
            return 0
        # Every arena checked before any byte moves: by the first `copy_rows` call where that covers them all (see
        # `__init__`), else here (each call checks its own arena again).
        if not self._first_call_checks and (min(device) < 0 or max(device) >= limits[0] or min(host) < 0
                                            or max(host) >= limits[1]):
            raise CopyError(f"ids out of range (device < {limits[0]}, host < {limits[1]})")
        copy = self.mover.rows
        n = 0
        try:
            for flat, stride, hflat, unit, row in self._rows:
                n += copy(hflat, unit, host, flat, stride, device, row, SAVE_GIL_BYTES) if to_host else \
                    copy(flat, stride, device, hflat, unit, host, row, LOAD_GIL_BYTES)
        except MoveError as e:
            raise CopyError(str(e)) from None
        self.bytes_copied += n
        return n

    # -- planning -------------------------------------------------------------------------------------------------
    def _plan(self, device: Sequence[int], host: Sequence[int], bounded: Sequence[tuple[str, int, int]],
              to_host: bool) -> list[Callable[[], int]]:
        if len(device) != len(host):
            raise CopyError(f"{len(device)} device blocks against {len(host)} host slots")
        jobs: list[Callable[[], int]] = []
        # Each plan is made once per order, at the first arena that needs it (arenas of one layout usually share one);
        # the bounds come with the first plan (every order needs one: all its arenas are checked).
        every_run: list[tuple[int, int, int]] | None = None
        split: tuple[list[tuple[int, int, int]], np.ndarray, np.ndarray] | None = None
        bounds: Bounds | None = None
        repack_plan: tuple[list[tuple[int, int, int]], np.ndarray, np.ndarray, Bounds | None] | None = None
        native_rows = NATIVE is not None and self.use_copy_rows
        if len(device) and native_rows:
            # `copy_rows` needs no plan; the bounds let every arena be checked before any byte moves.
            bounds = (min(device), max(device), min(host), max(host))
        elif len(device):
            if self._any_gather:
                long_runs, gather_d, gather_h, bounds = plan_runs(device, host)
                split = (long_runs, gather_d, gather_h)
            else:
                every_run, _, _, bounds = plan_runs(device, host, 1)
        for a in self.arenas:
            if a.host is None:
                continue
            if a.paged:
                if bounds is None:
                    continue  # no pages in this order
                self._check(a, *bounds)
                if a.repack and self.batch_repack:
                    if repack_plan is None:  # one plan for every repacked arena of the order
                        repack_plan = plan_runs(device, host)
                    jobs += self._repack_copies(a, repack_plan, to_host)
                    continue
                if native_rows and not a.repack:
                    assert a.host_flat is not None
                    row, unit = a.rows.shape[1], a.host.shape[1]
                    jobs.append(_RowCopy(self.mover, a.host_flat, unit, host, a.flat, a.stride, device, row,
                                         SAVE_GIL_BYTES) if to_host else
                                _RowCopy(self.mover, a.flat, a.stride, device, a.host_flat, unit, host, row,
                                         LOAD_GIL_BYTES))
                    continue
                if self._per_run(a):
                    if every_run is None:
                        every_run = runs(device, host)
                    jobs += [self._job(a, d0, h0, k, to_host) for d0, h0, k in every_run]
                    continue
                assert split is not None  # planned above: this arena is paged, small-block and not repacked
                long_runs, gather_d, gather_h = split
                for d0, h0, k in long_runs:
                    jobs.append(self._job(a, d0, h0, k, to_host))
                if gather_d.size:
                    jobs += _gather_copies(a.host, gather_h, a.rows, gather_d) if to_host else \
                        _gather_copies(a.rows, gather_d, a.host, gather_h)
            else:
                for group, dslot, hslot in bounded:
                    if group == a.group:
                        self._check(a, dslot, dslot, hslot, hslot)
                        jobs.append(self._job(a, dslot, hslot, 1, to_host))
        return jobs

    @staticmethod
    def _per_run(a: _Arena) -> bool:
        """No gather for this arena: big blocks copy best one slice per run, and repacked arenas batch their blocks
        through the hook instead (`_repack_copies`). Otherwise long runs go as slices and the rest in one gather."""
        return a.repack or a.rows.shape[1] >= GATHER_MAX_BLOCK_BYTES

    @staticmethod
    def _check(a: _Arena, dmin: int, dmax: int, hmin: int, hmax: int) -> None:
        assert a.host is not None
        if dmin < 0 or dmax >= a.rows.shape[0] or hmin < 0 or hmax >= a.host.shape[0]:
            raise CopyError(f"arena {a.name}: ids out of range (device < {a.rows.shape[0]}, host < {a.host.shape[0]})")

    def _repack_copies(self, a: _Arena, plan: tuple[list[tuple[int, int, int]], np.ndarray, np.ndarray, Bounds | None],
                       to_host: bool) -> list[Callable[[], int]]:
        """The order's blocks of a repacked arena through the hook: a run of at least `LONG_RUN` blocks as its own
        batch (slices, no gather), all the rest together in batches of up to `GATHER_CHUNK_BYTES` of stored rows,
        whatever runs they come from. The hook is per block (kv-contract: `(n_blocks, bytes)` tensors), and one call
        per run cost its fixed cost per scattered block (~90 us a block for the MLA wire layout)."""
        if self.repack_fn is None:
            raise CopyError(f"arena {a.name} declares a stored layout but the store has no repack hook")
        fn = self.repack_fn
        assert a.host is not None
        long_runs, d, h, _ = plan  # `plan_runs(device ids, host slots)`
        jobs: list[Callable[[], int]] = [self._job(a, d0, h0, k, to_host) for d0, h0, k in long_runs]
        if d.size == 1:  # one short run of one block: a slice is cheaper than a gather and a scatter
            return jobs + [self._job(a, int(d[0]), int(h[0]), 1, to_host)]
        per = max(1, GATHER_CHUNK_BYTES // max(1, a.host.shape[1]))
        row = a.rows.shape[1]
        for i in range(0, d.size, per):
            if to_host:
                jobs.append(_RepackCopy(fn, a.group, a.ident, RepackDirection.SAVE, a.rows, d[i : i + per],
                                        a.host, h[i : i + per], row))
            else:
                jobs.append(_RepackCopy(fn, a.group, a.ident, RepackDirection.LOAD, a.host, h[i : i + per],
                                        a.rows, d[i : i + per], row))
        return jobs

    def _job(self, a: _Arena, d0: int, h0: int, k: int, to_host: bool) -> Callable[[], int]:
        assert a.host is not None
        if not a.repack:
            if to_host:
                return _slice_copy(a.host, h0, a.rows, d0, k)
            return _slice_copy(a.rows, d0, a.host, h0, k)
        fn = self.repack_fn
        if fn is None:
            raise CopyError(f"arena {a.name} declares a stored layout but the store has no repack hook")
        host_rows, dev_rows, group, ident = a.host, a.rows, a.group, a.ident

        def run() -> int:
            if to_host:
                src = torch.from_numpy(np.ascontiguousarray(dev_rows[d0 : d0 + k]))
                dst = torch.empty((k, host_rows.shape[1]), dtype=torch.uint8)
                call_hook(fn, group, RepackDirection.SAVE, src, dst, ident)
                host_rows[h0 : h0 + k] = dst.numpy()
            else:
                src = torch.from_numpy(np.ascontiguousarray(host_rows[h0 : h0 + k]))
                dst = torch.empty((k, dev_rows.shape[1]), dtype=torch.uint8)
                call_hook(fn, group, RepackDirection.LOAD, src, dst, ident)
                dev_rows[d0 : d0 + k] = dst.numpy()
            return k * dev_rows.shape[1]

        return run

    def _run(self, jobs: list[Callable[[], int]]) -> int:
        try:
            return self._run_jobs(jobs)
        except RepackError as e:
            self.repack_failures.record(e)
            raise

    def _run_jobs(self, jobs: list[Callable[[], int]]) -> int:
        total = sum(j.nbytes for j in jobs if isinstance(j, _SIZED))
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


@dataclass(frozen=True)
class _GatherCopy:
    """dst[dst_ids] = src[src_ids] over (rows, bytes) views: one gather and one scatter, both in C."""

    dst: np.ndarray
    dst_ids: np.ndarray
    src: np.ndarray
    src_ids: np.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.src_ids.size) * self.src.shape[1]

    def __call__(self) -> int:
        self.dst[self.dst_ids] = self.src[self.src_ids]
        return self.nbytes


@dataclass(frozen=True)
class _RowCopy:
    """Row dst_ids[i] of `dst` = row src_ids[i] of `src` over flat byte buffers (rows `*_stride` bytes apart): one
    `mover.rows` call (`kvproc.native._native.copy_rows` for memmove), ids checked first, one memmove per run."""

    mover: Mover
    dst: np.ndarray
    dst_stride: int
    dst_ids: Sequence[int]
    src: np.ndarray
    src_stride: int
    src_ids: Sequence[int]
    row: int
    gil_bytes: int  # release the GIL for a copy of at least this many bytes (`SAVE_GIL_BYTES` / `LOAD_GIL_BYTES`)

    @property
    def nbytes(self) -> int:
        return len(self.dst_ids) * self.row

    def part(self, lo: int, hi: int) -> "_RowCopy":
        return _RowCopy(self.mover, self.dst, self.dst_stride, self.dst_ids[lo:hi], self.src, self.src_stride,
                        self.src_ids[lo:hi], self.row, self.gil_bytes)

    def __call__(self) -> int:
        try:
            return self.mover.rows(self.dst, self.dst_stride, self.dst_ids, self.src, self.src_stride,
                                   self.src_ids, self.row, self.gil_bytes)
        except MoveError as e:  # checked by the plan already: a stale layout, say, not a bad order
            raise CopyError(str(e)) from None


@dataclass(frozen=True)
class _RepackCopy:
    """Rows `dst_ids` of `dst` = the model's repack of rows `src_ids` of `src`, as one batch: a gather (fancy index,
    one C pass into a contiguous tensor), one hook call, a scatter. `device_row`: the bytes a block has on the device
    (what the copy reports, like the other jobs)."""

    fn: RepackFn
    group: str
    ident: ArenaId
    direction: RepackDirection
    src: np.ndarray
    src_ids: np.ndarray
    dst: np.ndarray
    dst_ids: np.ndarray
    device_row: int

    @property
    def nbytes(self) -> int:
        return int(self.src_ids.size) * self.src.shape[1]

    def __call__(self) -> int:
        src = torch.from_numpy(self.src[self.src_ids])
        out = torch.empty((int(self.dst_ids.size), self.dst.shape[1]), dtype=torch.uint8)
        call_hook(self.fn, self.group, self.direction, src, out, self.ident)
        self.dst[self.dst_ids] = out.numpy()
        return int(self.dst_ids.size) * self.device_row


def device_of(layout: ArenaLayout) -> str:
    """The device every arena of a layout is on ("cpu", "cuda:0"); arenas on two devices are a layout error."""
    devices = {str(a.tensor.device) for _, a in layout.arenas}
    if len(devices) > 1:
        raise CopyError(f"arenas on more than one device: {sorted(devices)}")
    return devices.pop() if devices else "cpu"


_SIZED = (_SliceCopy, _GatherCopy, _RowCopy, _RepackCopy)  # jobs that know their byte count (the two-thread split)

GATHER_CHUNK_BYTES = 4 << 20  # bounds the gather's temporary, and gives the two copy threads pieces to share


def _gather_copies(dst: np.ndarray, dst_ids: np.ndarray, src: np.ndarray, src_ids: np.ndarray) -> list[_GatherCopy]:
    per = max(1, GATHER_CHUNK_BYTES // max(1, src.shape[1]))
    return [_GatherCopy(dst, dst_ids[i : i + per], src, src_ids[i : i + per]) for i in range(0, dst_ids.size, per)]


def _slice_copy(dst: np.ndarray, d0: int, src: np.ndarray, s0: int, k: int) -> _SliceCopy:
    return _SliceCopy(dst, d0, src, s0, k)


def _halve(jobs: list[Callable[[], int]], total: int) -> tuple[list[Callable[[], int]], list[Callable[[], int]]]:
    first: list[Callable[[], int]] = []
    second: list[Callable[[], int]] = []
    acc = 0
    for j in jobs:
        nb = j.nbytes if isinstance(j, _SIZED) else 0
        if acc >= total // 2:
            second.append(j)
        elif isinstance(j, _RowCopy) and acc + nb > total // 2 and len(j.dst_ids) > 1:
            cut = max(1, min(len(j.dst_ids) - 1, (total // 2 - acc) // j.row))
            first.append(j.part(0, cut))
            second.append(j.part(cut, len(j.dst_ids)))
            acc = total
        elif isinstance(j, _SliceCopy) and acc + nb > total // 2 and j.k > 1:
            cut = max(1, min(j.k - 1, (total // 2 - acc) // j.src.shape[1]))
            first.append(_SliceCopy(j.dst, j.d0, j.src, j.s0, cut))
            second.append(_SliceCopy(j.dst, j.d0 + cut, j.src, j.s0 + cut, j.k - cut))
            acc = total
        else:
            first.append(j)
            acc += nb
    return first, second
