"""`CopyWorkerRole`: one rank's copy worker process. It maps the scheduler's arena segments and the host tier's
segment, and executes copy orders over them with `CopyExecutor` (coalesced slice copies, two threads for big batches).

Protocol: `AttachArenas` first (the scheduler's `RemoteCopier` sends it, and sends it again to a restarted worker
before its next order; how its arena references become memory and which mover it asks for: `device_attach.py`);
then `Save` / `Load` / `DeviceCopy`, each answered `Copied(nbytes)` or a typed `Failed`. A save or device copy that
carries the engine's step event (`after_event`) runs after it on a CUDA attach, and is refused as
`event_unsupported` on a CPU one (`kvproc/workers/engine_fence.py`).
A copy that started is not cancellable: the handler never checks the deadline or the token mid-copy, so the reply is
always the real outcome (the caller keeps the destination reserved until it arrives).

Threads: handlers run on the server's pool; the current attachment (executor + mapped segments) is swapped under
`self._lock`, and an order takes a reference to it first, so a re-attach never unmaps memory a copy is using.
"""

from __future__ import annotations

import importlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import structlog

from kvproc.contract import GroupKind, GroupSpec, KvArena, KvSpec, check_repack_hook, validate_layout
from kvproc.ipc import messages as m
from kvproc.ipc.context import CallContext
from kvproc.ipc.errors import HandlerError
from kvproc.ipc.segment import Segment, SegmentBusyError, SegmentError
from kvproc.ipc.service import handles
from kvproc.runtime.histogram import Histogram
from kvproc.runtime.role import Role, RoleEnv
from kvproc.tiers import save_fence
from kvproc.tiers.host import layout_from_wire
from kvproc.workers.copy_exec import CopyError, CopyExecutor, RepackError
from kvproc.workers.device_attach import (
    arenas_on_gpu,
    attach_mover,
    cuda_arena_view,
    device_arena_view,
    gpu_mover_kind,
    pin_host,
)
from kvproc.workers.engine_fence import EngineEventError
from kvproc.workers.movers import CUDA_MOVERS

log = structlog.get_logger("kvproc.copy_worker")
_COUNTER_NAMES = {k: (f"orders_{k}", f"bytes_{k}", f"ns_{k}") for k in ("save", "load", "device", "engine")}
_COPY_LATENCY = {k: Histogram("copy_latency_seconds", k) for k in _COUNTER_NAMES}  # one copy order's time, in situ


def import_callable(path: str) -> Callable[..., Any]:
    """"module:attr" (attr may be dotted, e.g. "mod:Class.method" for a staticmethod) -> the callable."""
    module, sep, attr = path.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"repack path {path!r} must look like 'package.module:function'")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    if not callable(obj):
        raise TypeError(f"repack path {path!r} names a {type(obj).__name__}, not a callable")
    return obj


@dataclass
class _Attachment:
    executor: CopyExecutor
    segments: dict[str, Segment]
    arenas: int
    host_bytes: int
    load_fences: np.ndarray | None = None  # the store's load-fence words (`kvproc/tiers/load_fence.py`)
    host_epoch: int = 0  # `AttachArenas.host_epoch`: a load from another attachment's tier is refused


class CopyWorkerRole(Role):
    name = "copy_worker"
    needs_torch = True  # preloaded in the forkserver: a restart forks in milliseconds instead of importing torch
    restartable = True
    # Loads sit on a resolve's critical path (and device copies between two steps): run them on the socket thread,
    # saving two thread hand-offs per order. A copy is not cancellable anyway, and this process's only client is its
    # store. Saves are background work and may be large: they stay on the handler pool.
    inline = frozenset({m.Load, m.DeviceCopy, m.EngineMove})

    def __init__(self, env: RoleEnv) -> None:
        super().__init__(env)
        if nbytes := int(env.options.get("segment_bytes", 0)):
            self.create_segment(nbytes)  # scratch segment (runtime tests of segment clean-up)
        self.threads = int(env.options.get("copy_threads", 2))
        # The GPU this worker is bound to (one copy worker per GPU): its rank's, unless the options name one.
        self.cuda_device = int(env.options.get("cuda_device", env.rank))
        self._lock = threading.Lock()
        self._current: _Attachment | None = None
        self._retired: list[Segment] = []  # mappings of earlier attachments still viewed by a running copy

    # ---- attach ----

    @handles(m.AttachArenas)
    def attach_arenas(self, msg: m.AttachArenas, ctx: CallContext) -> m.Attached:
        with self._lock:
            old = self._current
            reuse = dict(old.segments) if old is not None else {}
        segments: dict[str, Segment] = {}

        def seg(name: str) -> Segment:
            if name not in segments:
                try:
                    segments[name] = reuse.pop(name) if name in reuse else Segment.attach(name)
                except SegmentError as e:
                    raise HandlerError("no_segment", str(e)) from None
            return segments[name]

        gpu = arenas_on_gpu(msg)
        # a CPU mover before anything is mapped; the CUDA one once the handles passed their checks
        cpu_mover = None if gpu else attach_mover(msg, False, self.cuda_device)
        if gpu:
            gpu_mover_kind(msg)  # a bad kind is refused before any handle is opened
        kinds: dict[str, GroupKind] = {}
        arenas: list[tuple[str, KvArena]] = []
        for ref in msg.arenas:
            kinds[ref.group] = GroupKind(ref.kind)
            view = cuda_arena_view(ref, self.cuda_device) if ref.cuda is not None else \
                device_arena_view(seg(ref.segment), ref)
            arenas.append((ref.group, KvArena(ref.name, view, ref.num_blocks,
                                              ref.bytes_per_block, ref.block_stride,
                                              ref.stored_bytes_per_block or None, ref.stored_layout or None)))
        mover = cpu_mover if cpu_mover is not None else attach_mover(msg, True, self.cuda_device)
        spec = KvSpec(msg.page_tokens, tuple(GroupSpec(g, k) for g, k in kinds.items()))
        layout = validate_layout(spec, arenas)
        host: np.ndarray | None = None
        host_layout = None
        if msg.host_segment:
            if msg.host_layout is None:
                raise HandlerError("bad_request", "AttachArenas names a host segment but no host layout")
            host_layout = layout_from_wire(msg.host_layout)
            hseg = seg(msg.host_segment)
            if hseg.nbytes < host_layout.total_bytes:
                raise HandlerError("bad_request", f"host segment {hseg.name} has {hseg.nbytes} B, layout needs"
                                                  f" {host_layout.total_bytes} B")
            if mover.name in CUDA_MOVERS:  # both CUDA movers read the segment by DMA or through its device mapping
                pin_host(hseg)
            host = hseg.numpy(np.uint8, 0, host_layout.total_bytes)
        try:
            repack = check_repack_hook(import_callable(msg.repack), msg.repack) if msg.repack else None
        except (ImportError, AttributeError, ValueError, TypeError) as e:  # KvContractError is a ValueError
            raise HandlerError("bad_repack", f"cannot import repack {msg.repack!r}: {e}") from None
        fences: np.ndarray | None = None
        if msg.load_fences:
            fseg = seg(msg.load_fences)
            if msg.load_fence_offset < 0 or msg.load_fence_offset + 8 * msg.load_fence_words > fseg.nbytes:
                raise HandlerError("bad_request", f"load fences [{msg.load_fence_offset}, +{8 * msg.load_fence_words})"
                                                  f" are outside {fseg.name} ({fseg.nbytes} B)")
            fences = fseg.numpy(np.int64, msg.load_fence_offset, msg.load_fence_words)
        executor = CopyExecutor(layout, host, host_layout, repack, threads=self.threads, mover=mover)
        del host, arenas, layout  # only the executor holds views now (so retired segments can unmap)
        new = _Attachment(executor, segments, len(msg.arenas), host_layout.total_bytes if host_layout else 0,
                          load_fences=fences, host_epoch=msg.host_epoch)
        del fences
        with self._lock:
            self._current = new
            self._retired.extend(reuse.values())  # segments of the old attachment nobody names any more
            retired, self._retired = self._retired, []
        if old is not None:
            old.executor.close()
            del old
        self._retired = self._close_unused(retired)
        self.counters.inc("attaches")
        log.info("arenas_attached", arenas=new.arenas, host_bytes=new.host_bytes, repack=msg.repack or None,
                 mover=mover.name)
        return m.Attached(new.arenas, new.host_bytes)

    @staticmethod
    def _close_unused(segments: list[Segment]) -> list[Segment]:
        busy = []
        for s in segments:
            try:
                s.close()
            except SegmentBusyError:  # a copy of the old attachment is still running: unmap on a later attach
                busy.append(s)
        return busy

    def _attachment(self) -> _Attachment:
        with self._lock:
            cur = self._current
        if cur is None:
            raise HandlerError("not_attached", "copy worker has no arenas: send AttachArenas first")
        return cur

    # ---- orders ----

    def _execute(self, kind: str, fn: Callable[[CopyExecutor], int], host_epoch: int | None = None) -> m.Copied:
        att = self._attachment()
        if host_epoch is not None and host_epoch != att.host_epoch:
            # Its slots index a replaced tier's segment, not the one mapped now: reading them would load another
            # tier's pages. Refused whole; the store recomputes.
            self.counters.inc(f"{kind}s_stale_host_tier")
            raise HandlerError("stale_host_tier", f"{kind} order from host attachment {host_epoch}, attached to "
                                                  f"{att.host_epoch} (the host tier was replaced)")
        t0 = time.perf_counter_ns()
        try:
            n = fn(att.executor)  # not cancellable: no ctx.check() from here to the reply
        except EngineEventError as e:  # refused whole, before a byte moved: the order's own fault, not a copy's
            self.counters.inc_many((("copy_errors", 1), (f"{kind}s_{e.code}", 1)))
            raise HandlerError(e.code, str(e)) from None
        except RepackError as e:  # logged once per cause by the executor, with the hook's traceback
            self.counters.inc_many((("copy_errors", 1), (f"repack_failed.{e.arena.name}", 1)))
            raise HandlerError("repack_failed", str(e)) from None
        except CopyError as e:
            self.counters.inc("copy_errors")
            raise HandlerError("copy_error", str(e)) from None
        ns = time.perf_counter_ns() - t0
        orders, nbytes, nanos = _COUNTER_NAMES[kind]
        # ns: copy time in situ (console, benches), and its distribution (`copy_latency_seconds` in /metrics)
        # which mover moved it (`kvproc/workers/movers.py`): orders and bytes by mover, in stats and the console
        mover = att.executor.mover_name(kind)
        self.counters.inc_many(((orders, 1), (nbytes, n), (nanos, ns), (f"mover_orders.{mover}", 1),
                                (f"mover_bytes.{mover}", n), *_COPY_LATENCY[kind].keys(ns)))
        return m.Copied(n, ns)

    @handles(m.Save)
    def save(self, msg: m.Save, ctx: CallContext) -> m.Copied:
        return self._execute("save", lambda ex: ex.save(msg.order))

    def _fenced(self, kind: str, fence: int, token: int, fn: Callable[[CopyExecutor], int],
                host_epoch: int | None = None) -> m.Copied:
        """Holds the order's load fence for the whole write: an order its store gave up on (it may have freed the
        blocks or slots, e.g. while this process was stopped) writes nothing (`kvproc/tiers/load_fence.py`)."""
        fences = self._attachment().load_fences
        try:
            save_fence.claim(fences, fence, token)
        except save_fence.FenceRevoked as e:
            self.counters.inc(f"{kind}s_fence_revoked")
            raise HandlerError("fence_revoked", str(e)) from None
        try:
            return self._execute(kind, fn, host_epoch)
        finally:
            save_fence.release(fences, fence, token)

    @handles(m.Load)
    def load(self, msg: m.Load, ctx: CallContext) -> m.Copied:
        order = msg.order
        return self._fenced("load", order.fence, order.fence_token, lambda ex: ex.load(order), order.host_epoch)

    @handles(m.DeviceCopy)
    def device_copy(self, msg: m.DeviceCopy, ctx: CallContext) -> m.Copied:
        return self._fenced("device", msg.fence, msg.fence_token,
                            lambda ex: ex.device_copy(msg.copies, msg.after_event))

    @handles(m.EngineMove)
    def engine_move(self, msg: m.EngineMove, ctx: CallContext) -> m.Copied:
        """Blocks between an engine's own (private) memory and the arenas, by cross-memory attach: the engine
        allocated those tensors, so it names them by pid and address (the CPU analogue of a CUDA IPC handle)."""
        return self._execute("engine", lambda ex: ex.engine_move(
            msg.pid, msg.to_engine, msg.arenas, msg.engine_bases, msg.engine_stride, msg.block_bytes, msg.engine_ids,
            msg.arena_ids))

    def on_stop(self) -> None:
        with self._lock:
            cur, self._current = self._current, None
        if cur is not None:
            cur.executor.close()
            segs = list(cur.segments.values())
            del cur
            self._close_unused(segs)  # attached, not owned: never unlinked here
        super().on_stop()
