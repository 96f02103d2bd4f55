"""Register a shared-memory mapping as pinned (page-locked) host memory for GPU DMA, once per copying process.

Without CUDA this is a no-op (returns False: every copy is a CPU one and nothing needs pinning). With CUDA a failed
registration raises `PinError` at attach: never a silent pageable copy. Register after attaching, unregister before
unmapping (`Segment.close()` does the latter). PyTorch's pinned allocator would round sizes up to powers of two;
registering the existing mapping does not. Registered portable and mapped (`REGISTER_FLAGS`): every mover (`cuda`'s
DMA, `cuda_mapped`'s kernels) can use it. NEEDS-GPU-CHECK: the CUDA branch has never run (no GPU where it was
written); `torch.cuda.cudart()` is torch's binding of the CUDA runtime (no cupy needed).
"""

from __future__ import annotations

import sys

from kvproc.ipc.segment import Segment

_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context in the process
_CUDA_HOST_REGISTER_MAPPED = 2  # cudaHostRegisterMapped: mapped into the device address space (the cuda_mapped mover)
# Portable alone does not promise a mapping (only cudaHostRegisterDefault does, "on a system with unified virtual
# addressing"); the cuda_mapped mover's kernels read and write the segment through its device mapping, so ask for it.
# Under UVA the device address is the host address where cudaDevAttrCanUseHostPointerForRegisteredMem is 1.
REGISTER_FLAGS = _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED


class PinError(RuntimeError):
    """cudaHostRegister / cudaHostUnregister failed for a segment (the CUDA error is in the message)."""


def _cuda_available() -> bool:
    torch = sys.modules.get("torch")  # never import torch just to learn there is no GPU
    return torch is not None and bool(torch.cuda.is_available())


def _error(cudart: object, err: object) -> str:
    try:
        return f"{int(err)} ({cudart.cudaGetErrorString(err)})"  # type: ignore[attr-defined, call-overload]
    except Exception:  # noqa: BLE001 - the message is best effort; the code is what matters
        return str(err)


def register_address(address: int, nbytes: int, what: str) -> None:
    """cudaHostRegister(address, nbytes, portable | mapped); `PinError` naming `what` on failure. Needs CUDA."""
    import torch

    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(address, nbytes, REGISTER_FLAGS)
    if int(err) != 0:
        raise PinError(f"cudaHostRegister({what}, {nbytes} B) failed: CUDA error {_error(cudart, err)}; refusing "
                       "pageable copies")


def unregister_address(address: int, what: str) -> None:
    """cudaHostUnregister(address); `PinError` naming `what` on failure. Needs CUDA."""
    import torch

    cudart = torch.cuda.cudart()
    err = cudart.cudaHostUnregister(address)
    if int(err) != 0:
        raise PinError(f"cudaHostUnregister({what}) failed: CUDA error {_error(cudart, err)}")


def register(segment: Segment) -> bool:
    """Pin the segment's mapping; returns True if it is now pinned, False on a CPU-only process."""
    if segment.pinned or not _cuda_available():
        return segment.pinned
    register_address(segment.address(), segment.nbytes, segment.name)
    segment.pinned = True
    return True


def unregister(segment: Segment) -> None:
    """Unpin; must run before the mapping is unmapped (`Segment.close` calls it first)."""
    if not segment.pinned:
        return
    segment.pinned = False
    unregister_address(segment.address(), segment.name)
