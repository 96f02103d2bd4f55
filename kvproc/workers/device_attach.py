"""How an `AttachArenas` becomes memory and a mover in the copy worker: shared-memory arena references (CPU), CUDA
IPC arena references (a GPU engine's arenas, opened on the worker's bound device), the host segment pinned for a GPU
executor, and the mover the attach asks for. Every refusal is a `HandlerError` with a stable code, raised before
anything is opened where it can be.

NEVER RUN with CUDA (no GPU where it was written): `open_arena` and pinning. What runs on CPU, in a real copy worker
(tests/workers/test_worker_attach.py): the wire form and the handle it names, the device and geometry checks, the
mixed-arenas and mover-kind refusals, `no_cuda`, and the pin-failure refusal with a stub `register`.
"""

from __future__ import annotations

import torch

from kvproc.ipc import messages as m
from kvproc.ipc import pinning
from kvproc.ipc.cuda_ipc import CudaArenaHandle, CudaIpcError, check_geometry
from kvproc.ipc.errors import HandlerError
from kvproc.ipc.segment import Segment
from kvproc.workers.movers import CUDA_MOVERS, MoveError, Mover, mover_for


def device_arena_view(seg: Segment, ref: m.ArenaRef) -> torch.Tensor:
    """A CPU arena reference (segment + offset) as memory this process can copy from and to; a GPU arena's is
    `cuda_arena_view`."""
    nbytes = (ref.num_blocks - 1) * ref.block_stride + ref.bytes_per_block
    if ref.offset < 0 or ref.offset + nbytes > seg.nbytes:
        raise HandlerError("bad_request", f"arena {ref.name}: [{ref.offset}, +{nbytes}) is outside {seg.name}"
                                          f" ({seg.nbytes} B)")
    return seg.torch(torch.uint8, ref.offset, nbytes)


def cuda_handle(ref: m.ArenaRef) -> CudaArenaHandle:
    """The `CudaArenaHandle` an `ArenaRef` with a CUDA IPC handle names (runs anywhere: no CUDA call)."""
    assert ref.cuda is not None
    return CudaArenaHandle(ref.name, ref.cuda, ref.offset, ref.num_blocks, ref.bytes_per_block, ref.block_stride)


def cuda_arena_view(ref: m.ArenaRef, device: int) -> torch.Tensor:
    """A GPU arena reference opened by CUDA IPC on this worker's device, no copy. NEVER RUN past the checks (no GPU
    where it was written): the device and geometry checks (`check_geometry`) and the refusal without CUDA run on CPU
    (tests/workers/test_worker_attach.py); `open_arena` itself has never run."""
    h = cuda_handle(ref)
    try:
        check_geometry(h, device)
    except CudaIpcError as e:
        raise HandlerError("bad_request", str(e)) from None
    if not torch.cuda.is_available():
        raise HandlerError("no_cuda", f"arena {ref.name} is a CUDA IPC handle, and this copy worker has no CUDA "
                                      "device (torch.cuda.is_available() is False)")
    from kvproc.ipc.cuda_ipc import open_arena

    try:
        return open_arena(h, device)
    except CudaIpcError as e:
        raise HandlerError("bad_arena", str(e)) from None


def arenas_on_gpu(msg: m.AttachArenas) -> bool:
    """Whether the attach's arenas are CUDA IPC handles; all of them or none (checked before anything is opened)."""
    on_gpu = {ref.cuda is not None for ref in msg.arenas}
    if len(on_gpu) > 1:
        raise HandlerError("bad_request", "AttachArenas mixes CUDA IPC arenas and shared-memory arenas")
    return True in on_gpu


def gpu_mover_kind(msg: m.AttachArenas) -> str:
    """The `mover_for` kind for GPU arenas ("", "torch", "cuda": the staged cuda mover; "cuda_mapped": the mapped
    one); any other is refused (checked before anything is opened)."""
    if msg.mover not in ("", "torch", *CUDA_MOVERS):
        raise HandlerError("bad_request", f"AttachArenas: GPU arenas move with the cuda or cuda_mapped mover, not "
                                          f"{msg.mover!r}")
    return "cuda_mapped" if msg.mover == "cuda_mapped" else ""


def attach_mover(msg: m.AttachArenas, gpu: bool, device: int) -> Mover:
    """The mover an attach asks for: for GPU arenas a CUDA one bound to this worker's device (`gpu_mover_kind`),
    else `mover_for` on CPU with the message's kind ("" = memmove, "torch"; a CUDA kind is refused)."""
    try:
        if gpu:
            return mover_for(f"cuda:{device}", kind=gpu_mover_kind(msg))
        return mover_for("cpu", kind=msg.mover)
    except MoveError as e:
        raise HandlerError("bad_request", f"AttachArenas: {e}") from None


def pin_host(seg: Segment) -> None:
    """Pin the host segment for DMA (`cudaHostRegister`) before a GPU executor uses it: a failure refuses the attach,
    never a silent pageable copy. NEVER RUN with CUDA (without it `register` is a no-op that returns False)."""
    try:
        pinning.register(seg)
    except pinning.PinError as e:
        raise HandlerError("pin_failed", str(e)) from None
