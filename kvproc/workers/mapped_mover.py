"""The mapped CUDA mover (`cuda_mapped`): the GPU's own gather and scatter kernels read and write the pinned host rows
across the bus, with no pinned staging tensor and no host-side memcpy. NEVER RUN: written on a machine without a
GPU; its CUDA tests are skipped there (tests/workers/test_mapped_mover.py), `kvproc bench gpu` measures it against
the staged `cuda` mover and pinned `copy_(non_blocking=True)` on a GPU.

Why it exists: `CudaMover` (`cuda_mover.py`) gathers a load's host rows on the CPU into pinned staging (and scatters
a save's from it), one extra memcpy of every byte on one core, the known risk for the >= 0.8x-of-`copy_` target.
Here the host segment, pinned by `kvproc.ipc.pinning.register` (portable | mapped), is viewed as a CUDA tensor that
aliases the host memory; `index_select` (gather) and `index_copy_` (scatter) then run on the worker's save / load
stream with one side in host memory, so every byte crosses the bus once, moved by the GPU.

How the host side becomes a CUDA tensor: under unified virtual addressing a registered host buffer's device address
is its host address wherever the device reports cudaDevAttrCanUseHostPointerForRegisteredMem (every x86-64 Linux
GPU of this era); the view is an object with `__cuda_array_interface__` (that address, the rows' shape and byte
strides) passed to `torch.as_tensor(..., device=)`. Chosen over asking cupy for the device pointer
(`runtime.pointerGetAttributes(...).devicePointer`; cupy has no `hostGetDevicePointer`): kvproc does not import cupy
(an optional extra a copy worker's image may lack). Before the view is built, `mapped` asks torch's `is_pinned`
(cudaPointerGetAttributes: memory type host), so an unregistered segment is a clear `MoveError`, never a kernel
touching an unmapped address (torch itself does not check when the device index is given). `kvproc bench gpu`'s
sanity group checks the equal-address assumption with cupy where cupy imports. A view that torch would copy (a
device other than the registering one) is refused too (its data pointer is compared).

Rows are moved as the widest of 8 / 4 / 2 / 1-byte integers that divides the row, both strides and both start
addresses (a byte-per-thread kernel would cut every transfer across the bus into tiny requests). The gather completes
before the scatter (a device tensor between them), so a batch within one buffer moves its rows as they were. The
id checks, batch contract and counters are the torch mover's (`rows`), run on CPU in every test run.
"""

from __future__ import annotations

from typing import Any

import torch

from kvproc.workers.cuda_mover import CudaMover
from kvproc.workers.movers import MoveError
from kvproc.workers.torch_mover import TorchRowsMover

WIDE = ((8, torch.int64, "<i8"), (4, torch.int32, "<i4"), (2, torch.int16, "<i2"), (1, torch.uint8, "|u1"))
TYPESTR = {dtype: typestr for _, dtype, typestr in WIDE}


def element_bytes(row: int, *views: torch.Tensor) -> int:
    """The widest element (8, 4, 2 or 1 bytes) that divides `row` and every (rows, row) uint8 view's row stride,
    storage offset and data address: what `widen` may view them as."""
    for width, _, _ in WIDE:
        if row % width == 0 and all(v.stride(0) % width == 0 and v.storage_offset() % width == 0
                                    and v.data_ptr() % width == 0 for v in views):
            return width
    return 1


def widen(view: torch.Tensor, width: int) -> torch.Tensor:
    """A (rows, row) uint8 view as (rows, row / width) integers of `width` bytes: the same memory, no copy."""
    dtype = next(d for w, d, _ in WIDE if w == width)
    return view if width == 1 else view.view(dtype)


class HostRows:
    """A CPU tensor over registered host memory, described by `__cuda_array_interface__` (version 3) at the same
    address: what `torch.as_tensor(..., device="cuda:N")` turns into a CUDA tensor aliasing the host rows. It keeps
    the CPU tensor (and so the mapping under it) alive as long as the CUDA tensor."""

    def __init__(self, host: torch.Tensor) -> None:
        self.host = host
        size = host.element_size()
        self.__cuda_array_interface__: dict[str, Any] = {
            "shape": tuple(host.shape), "strides": tuple(s * size for s in host.stride()),
            "typestr": TYPESTR[host.dtype], "data": (host.data_ptr(), False), "version": 3, "stream": None}


def mapped(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU view of registered memory) as a CUDA tensor on `device` at the same address. Refuses (MoveError)
    memory CUDA does not know as pinned (`is_pinned`: cudaPointerGetAttributes), before any kernel could touch it,
    and a view torch would copy instead of aliasing."""
    if not host.is_pinned():
        raise MoveError(f"the host rows at {host.data_ptr():#x} are not pinned: register them (kvproc.ipc.pinning) "
                        "before the cuda_mapped mover maps them")
    t = torch.as_tensor(HostRows(host), device=device)
    if t.data_ptr() != host.data_ptr() or t.device != device:
        raise MoveError(f"the host rows at {host.data_ptr():#x} were copied to {t.device}, not mapped: register them "
                        f"(kvproc.ipc.pinning) with {device} current")
    return t


class MappedMover(CudaMover):
    """`CudaMover` whose host side is mapped into the device: the GPU gathers and scatters host rows itself."""

    name = "cuda_mapped"

    def _move(self, d: torch.Tensor, di: torch.Tensor, s: torch.Tensor, si: torch.Tensor, n: int, row: int) -> Any:
        if not (d.is_cuda or s.is_cuda):  # host to host: nothing for the GPU to do
            return TorchRowsMover._move(self, d, di, s, si, n, row)
        width = element_bytes(row, d, s)
        d, s = widen(d, width), widen(s, width)
        dd = d if d.is_cuda else mapped(d, self.device)
        ss = s if s.is_cuda else mapped(s, self.device)
        stream = self._stream(d, s)  # a fenced order's stream (the engine's step event waited on), else by direction
        # what this thread queued before (a repack hook's output) lands before the batch reads it; the engine's own
        # writes are ordered by `fenced` / `after(event)`
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            staged = ss.index_select(0, si.to(self.device, non_blocking=True))  # gather: reads host rows if ss is
            dd.index_copy_(0, di.to(self.device, non_blocking=True), staged)  # scatter: writes host rows if dd is
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()  # `rows` returns once the bytes are there (the CPU path's contract)
        return None
