"""CUDA IPC for device arenas: the scheduler exports an arena (an engine's CUDA tensor) once at attach, its rank's copy
worker opens it. NEVER RUN: written on a machine without a GPU; only `check_geometry` has run (tests/ipc).

The handle is torch's own CUDA storage sharing (`UntypedStorage._share_cuda_` / `_new_shared_cuda`, what
`torch.multiprocessing` sends for a CUDA tensor): it names the caching allocator's block, not the raw `cudaMalloc`
base, so an arena inside a bigger allocation opens at the right address (a bare `cudaIpcGetMemHandle` of the
tensor's pointer would name the whole allocation). The producer must keep the tensor alive while a worker has it open.
Like `ArenaRef`, the handle carries the geometry, and `open_arena` checks it (and the device) before any copy.

Events: an engine's step event crosses as its CUDA IPC event handle (`torch.cuda.Event(interprocess=True)
.ipc_handle()`, 64 bytes); the worker opens it with `open_event` and keeps what it opened in an `EventCache` (an
engine reuses a small ring of events, so the same few handles come back). NEVER RUN: `open_event`; the cache's
bookkeeping runs on CPU with a stub opener (tests/ipc/test_event_cache.py).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvproc.ipc.messages import CudaIpcRef

if TYPE_CHECKING:
    import torch


class CudaIpcError(RuntimeError):
    """An arena handle does not fit (wrong device, geometry outside the shared block) or could not be opened."""


@dataclass(frozen=True)
class CudaArenaHandle:
    name: str
    ipc: CudaIpcRef  # torch's `_share_cuda_` fields (the wire form), passed back unchanged to `_new_shared_cuda`
    offset: int  # the arena's first byte, counted from the shared storage's start
    num_blocks: int
    bytes_per_block: int
    block_stride: int

    @property
    def device(self) -> int:
        """The CUDA device index the arena lives on; the worker opening it must be bound to the same one."""
        return self.ipc.device

    @property
    def nbytes(self) -> int:
        return (self.num_blocks - 1) * self.block_stride + self.bytes_per_block


def check_geometry(h: CudaArenaHandle, device: int) -> None:
    """What `open_arena` checks before mapping anything: the device, and that the arena lies inside the storage."""
    if h.device != device:
        raise CudaIpcError(f"arena {h.name}: on cuda:{h.device}, this worker is bound to cuda:{device}")
    if h.num_blocks <= 0 or h.bytes_per_block <= 0 or h.block_stride < h.bytes_per_block:
        raise CudaIpcError(f"arena {h.name}: bad geometry ({h.num_blocks} blocks of {h.bytes_per_block} B, stride "
                           f"{h.block_stride})")
    if h.offset < 0 or h.offset + h.nbytes > h.ipc.storage_size_bytes:
        raise CudaIpcError(f"arena {h.name}: [{h.offset}, +{h.nbytes}) is outside the shared storage "
                           f"({h.ipc.storage_size_bytes} B)")


def export_arena(name: str, tensor: torch.Tensor, num_blocks: int, bytes_per_block: int,
                 block_stride: int) -> CudaArenaHandle:
    """In the scheduler (engine) process: the handle of a CUDA arena tensor. NEEDS-GPU-CHECK."""
    if not tensor.is_cuda:
        raise CudaIpcError(f"arena {name}: a {tensor.device} tensor has no CUDA IPC handle")
    storage = tensor.untyped_storage()
    dev, handle, size, off, rc_handle, rc_off, ev_handle, ev_sync = storage._share_cuda_()
    ipc = CudaIpcRef(int(dev), bytes(handle), int(size), int(off), bytes(rc_handle), int(rc_off), bytes(ev_handle),
                     bool(ev_sync))
    h = CudaArenaHandle(name, ipc, int(tensor.storage_offset()) * tensor.element_size(), num_blocks,
                        bytes_per_block, block_stride)
    check_geometry(h, int(dev))
    return h


def open_arena(h: CudaArenaHandle, device: int) -> torch.Tensor:
    """In the copy worker bound to `device`: the arena as a flat uint8 CUDA tensor over the engine's memory (no copy).
    NEEDS-GPU-CHECK."""
    check_geometry(h, device)
    import torch

    torch.cuda._lazy_init()
    try:
        c = h.ipc
        storage = torch.UntypedStorage._new_shared_cuda(
            c.device, c.storage_handle, c.storage_size_bytes, c.storage_offset_bytes, c.ref_counter_handle,
            c.ref_counter_offset, c.event_handle, c.event_sync_required)
    except RuntimeError as e:
        raise CudaIpcError(f"arena {h.name}: cannot open its CUDA IPC handle on cuda:{device}: {e}") from None
    t = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", device))
    return t.set_(storage, h.offset, (h.nbytes,), (1,))


EVENT_HANDLE_BYTES = 64  # sizeof(cudaIpcEventHandle_t)


def open_event(handle: bytes, device: int) -> Any:
    """In the copy worker bound to `device`: the engine's interprocess event named by `handle`, as a
    `torch.cuda.Event` this process can make a stream wait on. NEEDS-GPU-CHECK (never run)."""
    import torch

    try:
        # a torch.device, as torch's own event pickling rebuilds one (`torch.multiprocessing.reductions`)
        return torch.cuda.Event.from_ipc_handle(torch.device("cuda", device), handle)
    except RuntimeError as e:
        raise CudaIpcError(f"cannot open the engine's CUDA IPC event handle on cuda:{device}: {e}") from None


class EventCache:
    """Opened engine events by handle bytes, the `capacity` most recently used (an engine records into a small ring
    of interprocess events, so a few handles come back over and over: each is opened once, not per order). A handle
    of the wrong size is refused before anything is opened. Thread-safe (saves run on the worker's handler pool)."""

    def __init__(self, device: int, capacity: int = 32,
                 opener: Callable[[bytes, int], Any] = open_event) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.device, self.capacity, self._opener = device, capacity, opener
        self._events: OrderedDict[bytes, Any] = OrderedDict()
        self._lock = threading.Lock()
        self.opened = 0  # handles opened (a miss each): what the tests and counters read

    def get(self, handle: bytes) -> Any:
        if len(handle) != EVENT_HANDLE_BYTES:
            raise CudaIpcError(f"an engine event handle is {EVENT_HANDLE_BYTES} bytes (cudaIpcEventHandle_t), "
                               f"got {len(handle)}")
        with self._lock:
            ev = self._events.get(handle)
            if ev is not None:
                self._events.move_to_end(handle)
                return ev
            ev = self._opener(handle, self.device)  # under the lock: two orders never open one handle twice
            self.opened += 1
            self._events[handle] = ev
            if len(self._events) > self.capacity:
                self._events.popitem(last=False)  # the least recently used: dropping it destroys our opened copy
            return ev

    def __len__(self) -> int:
        return len(self._events)
