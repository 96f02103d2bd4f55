"""The CUDA parts of `kvproc bench gpu`: a quick sanity check of the CUDA environment, and the bandwidth of the two
CUDA movers against pinned `copy_(non_blocking=True)` measured in the same part. NEVER RUN: written without a GPU
(`kvproc bench gpu` prints SKIPPED for these on a machine without CUDA).

The host buffers are anonymous mappings registered with `kvproc.ipc.pinning.register_address` (portable | mapped),
as a copy worker's host segment is: page-aligned, pinned by cudaHostRegister, not torch's pinned allocator.
"""

from __future__ import annotations

import mmap
import traceback
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from kvproc.bench.copybench import best_time
from kvproc.bench.gpu_runner import Part
from kvproc.ipc import pinning
from kvproc.workers.movers import mover_for

DEVICE = "cuda:0"


def host_buffer(nbytes: int) -> np.ndarray:
    """Page-aligned host memory like a segment's mapping (an anonymous one), zeroed; not pinned."""
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


class Registered:
    """`with Registered(buf):` the buffer is pinned (cudaHostRegister, portable | mapped) inside the block."""

    def __init__(self, buf: np.ndarray, what: str) -> None:
        self.buf, self.what = buf, what

    def __enter__(self) -> np.ndarray:
        pinning.register_address(self.buf.ctypes.data, self.buf.nbytes, self.what)
        return self.buf

    def __exit__(self, *exc: object) -> None:
        pinning.unregister_address(self.buf.ctypes.data, self.what)


def _sync(fn: Callable[[], object]) -> Callable[[], None]:
    def run() -> None:
        fn()
        torch.cuda.synchronize()
    return run


# ---- sanity: a broken environment shows at once ----------------------------------------------------------------

def _device() -> list[dict[str, Any]]:
    p = torch.cuda.get_device_properties(0)
    return [{"check": "device", "ok": True, "device": torch.cuda.get_device_name(0), "count": torch.cuda.device_count(),
             "capability": f"{p.major}.{p.minor}", "memory_gib": round(p.total_memory / (1 << 30), 1),
             "torch": torch.__version__, "cuda_runtime": torch.version.cuda}]


def _pinned_round_trip() -> list[dict[str, Any]]:
    x = torch.randint(0, 256, (1 << 16,), dtype=torch.uint8).pin_memory()
    y = torch.zeros_like(x).pin_memory()
    y.copy_(x.to(DEVICE, non_blocking=True), non_blocking=True)
    torch.cuda.synchronize()
    return [{"check": "64 KiB pinned H2D + D2H", "ok": bool(torch.equal(x, y))}]


def _register() -> list[dict[str, Any]]:
    buf = host_buffer(1 << 20)
    t = torch.from_numpy(buf)
    before = bool(t.is_pinned())
    with Registered(buf, "a 1 MiB numpy buffer"):
        during = bool(t.is_pinned())
        dev = torch.arange(1 << 20, dtype=torch.int64, device=DEVICE).to(torch.uint8)
        t.copy_(dev, non_blocking=True)  # a DMA into the registered buffer
        torch.cuda.synchronize()
        dma = bool(torch.equal(t, dev.cpu()))
    after = bool(t.is_pinned())
    return [{"check": "cudaHostRegister / cudaHostUnregister of a numpy buffer", "ok": during and dma,
             "is_pinned_before": before, "is_pinned_registered": during, "is_pinned_after": after, "dma_ok": dma}]


def _segment() -> list[dict[str, Any]]:
    from kvproc.ipc.segment import Segment

    with Segment.create("gpucheck", "copy_worker", 1 << 20) as seg:
        pinned = pinning.register(seg)
        seg.close()  # unpins, then unmaps
        return [{"check": "a Segment pinned, unpinned before unmap", "ok": pinned and not seg.pinned}]


def _cupy_pointer() -> list[dict[str, Any]]:
    """Whether a registered buffer's device pointer is its host pointer (what the cuda_mapped mover assumes), asked
    of cupy (kvproc itself does not import it) where it imports."""
    try:
        import cupy  # type: ignore[import-not-found, unused-ignore]
    except Exception as e:  # noqa: BLE001 - an optional check: say why it did not run
        return [{"check": "device pointer of registered memory (cupy)", "ok": True, "cupy": f"not importable: {e}"}]
    buf = host_buffer(1 << 16)
    with Registered(buf, "a 64 KiB numpy buffer"):
        ptr = buf.ctypes.data
        at = cupy.cuda.runtime.pointerGetAttributes(ptr)  # cupy has no hostGetDevicePointer; this carries it
        dptr, kind, device = int(at.devicePointer), int(at.type), int(at.device)
    attr = int(cupy.cuda.runtime.deviceGetAttribute(91, 0))  # cudaDevAttrCanUseHostPointerForRegisteredMem
    return [{"check": "device pointer of registered memory (cupy)", "ok": dptr == ptr and kind == 1,
             "cupy": cupy.__version__, "host_pointer": hex(ptr), "device_pointer": hex(dptr),
             "memory_type": kind, "device": device, "can_use_host_pointer_for_registered_mem": attr}]


def _mapped_access() -> list[dict[str, Any]]:
    """A kernel writes, then reads, registered host memory through the cuda_mapped mover's view of it."""
    from kvproc.workers.mapped_mover import mapped

    buf = host_buffer(1 << 20)
    with Registered(buf, "a 1 MiB numpy buffer"):
        m = mapped(torch.from_numpy(buf).view(256, 4096), torch.device(DEVICE))
        m.fill_(7)
        torch.cuda.synchronize()
        wrote = bool((buf == 7).all())
        buf[:] = 3
        read = int(m.sum(dtype=torch.int64)) == 3 * buf.size
    return [{"check": "the GPU writes and reads mapped host memory", "ok": wrote and read, "wrote": wrote,
             "read": read}]


def _unregistered_refused() -> list[dict[str, Any]]:
    """Memory nobody registered is refused before a kernel could touch it (the view is never used)."""
    from kvproc.workers.mapped_mover import mapped
    from kvproc.workers.movers import MoveError

    buf = host_buffer(1 << 12)
    try:
        mapped(torch.from_numpy(buf).view(1, 4096), torch.device(DEVICE))
    except (MoveError, RuntimeError) as e:
        return [{"check": "unregistered host memory is refused a mapping", "ok": True, "error_seen": str(e)[:200]}]
    return [{"check": "unregistered host memory is refused a mapping", "ok": False,
             "error": "a CUDA view of unregistered host memory was built"}]


def sanity_parts() -> list[Part]:
    """Cheapest first; the mapped access last (an illegal address would poison this process's CUDA context)."""
    return [Part("sanity", name, fn) for name, fn in (
        ("device", _device), ("pinned round trip", _pinned_round_trip), ("cudaHostRegister", _register),
        ("segment pinning", _segment), ("cupy device pointer", _cupy_pointer),
        ("unregistered refused", _unregistered_refused), ("mapped access", _mapped_access))]


# ---- bandwidth ------------------------------------------------------------------------------------------------

def cuda_bandwidth(kind: str, block_bytes: int, batch_bytes: int, repeats: int) -> list[dict[str, Any]]:
    """Saves (D2H) and loads (H2D) of `kind`'s mover, contiguous and scattered, against pinned
    `copy_(non_blocking=True)` of the same bytes measured here (the D2H / H2D limit this run sees). Each row is
    isolated: a failure is recorded in it with its traceback and the next row runs."""
    mv = mover_for(DEVICE, kind=kind)
    n = max(2, batch_bytes // block_bytes)
    nb = n * block_bytes
    dev = torch.randint(0, 256, (2 * nb,), dtype=torch.uint8, device=DEVICE)
    buf = host_buffer(2 * nb)
    out: list[dict[str, Any]] = []
    with Registered(buf, f"{2 * nb} B of bandwidth buffer"):
        host = torch.from_numpy(buf)
        d2h = best_time(_sync(lambda: host[:nb].copy_(dev[:nb], non_blocking=True)), repeats, warm=True)
        h2d = best_time(_sync(lambda: dev[:nb].copy_(host[:nb], non_blocking=True)), repeats, warm=True)
        rng = np.random.default_rng(2)
        for shape in ("contiguous", "scattered"):
            ids = list(range(n)) if shape == "contiguous" else rng.permutation(2 * n)[:n].tolist()
            slots = list(range(n)) if shape == "contiguous" else rng.permutation(2 * n)[:n].tolist()
            for op, base in (("save", d2h), ("load", h2d)):
                row: dict[str, Any] = {"op": op, "block_bytes": block_bytes, "layout": shape, "mover": kind,
                                       "blocks": n, "baseline": "pinned copy_(non_blocking=True)",
                                       "baseline_gbps": nb / base / 1e9}
                try:
                    if op == "save":
                        move = partial(mv.rows, host, block_bytes, slots, dev, block_bytes, ids, block_bytes, 0)
                        got, want = host[slots[-1] * block_bytes:], dev[ids[-1] * block_bytes:]
                    else:
                        move = partial(mv.rows, dev, block_bytes, ids, host, block_bytes, slots, block_bytes, 0)
                        got, want = dev[ids[-1] * block_bytes:], host[slots[-1] * block_bytes:]
                    s = best_time(move, repeats, warm=True)
                    same = bool(torch.equal(got[:block_bytes].cpu(), want[:block_bytes].cpu()))  # the last row moved
                    row.update(ok=same, gbps=nb / s / 1e9, ratio=base / s,
                               **({} if same else {"error": "the last row moved differs"}))
                except Exception as e:  # noqa: BLE001 - one row's failure is recorded; the next row runs
                    row.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
                out.append(row)
    return out
