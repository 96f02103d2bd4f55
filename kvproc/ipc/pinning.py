"""Register a shared-memory mapping as pinned (page-locked) host memory for GPU DMA, once per copying process.

Without CUDA this is a no-op. Register after attaching, unregister before unmapping (`Segment.close()` does the
latter). PyTorch's pinned allocator would round sizes up to powers of two; registering the existing mapping does not.
"""

from __future__ import annotations

import sys

from kvproc.ipc.segment import Segment

_CUDA_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context in the process


def _cuda_available() -> bool:
    torch = sys.modules.get("torch")  # never import torch just to learn there is no GPU
    return torch is not None and bool(torch.cuda.is_available())


def register(segment: Segment) -> bool:
    """Pin the segment's mapping; returns True if it is now pinned, False on a CPU-only process."""
    if segment.pinned or not _cuda_available():
        return segment.pinned
    # NEEDS-GPU-CHECK: not exercised on the CPU-only development machines.
    import torch

    err = torch.cuda.cudart().cudaHostRegister(segment.address(), segment.nbytes, _CUDA_HOST_REGISTER_PORTABLE)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister({segment.name}, {segment.nbytes} B) failed with CUDA error {err}")
    segment.pinned = True
    return True


def unregister(segment: Segment) -> None:
    if not segment.pinned:
        return
    # NEEDS-GPU-CHECK: must run before the mapping is unmapped.
    import torch

    err = torch.cuda.cudart().cudaHostUnregister(segment.address())
    segment.pinned = False
    if int(err) != 0:
        raise RuntimeError(f"cudaHostUnregister({segment.name}) failed with CUDA error {err}")
