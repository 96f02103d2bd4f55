"""The CUDA mover: rows between a GPU arena and pinned host memory (or two GPU arenas) on the copy worker's own
streams. NEVER RUN: written on a machine without a GPU; every test of it is skipped there (tests/workers).

Same contract as every mover (`kvproc/workers/movers.py`): one call moves a whole batch, ids checked on the host before
any byte moves. The buffers are flat uint8 torch tensors (a GPU arena from `kvproc.ipc.cuda_ipc.open_arena`, a host
segment as `torch.from_numpy` of a mapping pinned by `kvproc.ipc.pinning.register`). A batch is one gather
(`index_select` into a contiguous staging tensor), one bulk copy across the bus and one scatter (`index_copy_`): three
calls per batch whatever its block count, never one per block. Saves (device -> host) run on `save_stream`, loads and
device -> device copies on `load_stream`, never on the engine's compute stream. `after(event)` makes the next batches
wait on an event the engine recorded (the step that wrote the pages); `rows` returns once its batch is done (it
synchronises its own event), which is the CPU path's contract: the engine-side event a load could signal instead is
not written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvproc.workers.movers import MoveError


class CudaMover:
    name = "cuda"
    host_views = False

    def __init__(self, device: int = 0) -> None:
        import torch

        if not torch.cuda.is_available():
            raise MoveError("the CUDA mover needs a CUDA device; torch.cuda.is_available() is False")
        self.torch = torch
        self.device = torch.device("cuda", device)
        self.save_stream = torch.cuda.Stream(self.device)
        self.load_stream = torch.cuda.Stream(self.device)

    def after(self, event: Any, saves: bool = True) -> None:
        """The next batches on that stream wait for `event` (recorded by the engine on its own stream)."""
        (self.save_stream if saves else self.load_stream).wait_event(event)

    def rows(self, dst: Any, dst_stride: int, dst_ids: Sequence[int], src: Any, src_stride: int,
             src_ids: Sequence[int], row: int, gil_bytes: int) -> int:
        torch = self.torch
        n = len(dst_ids)
        if n != len(src_ids):
            raise MoveError(f"{n} destination rows against {len(src_ids)} source rows")
        if n == 0:
            return 0
        d, s = _rows_view(torch, dst, dst_stride, row), _rows_view(torch, src, src_stride, row)
        di = torch.as_tensor(dst_ids, dtype=torch.int64)
        si = torch.as_tensor(src_ids, dtype=torch.int64)
        if int(di.min()) < 0 or int(di.max()) >= d.shape[0] or int(si.min()) < 0 or int(si.max()) >= s.shape[0]:
            raise MoveError(f"ids out of range (destination < {d.shape[0]}, source < {s.shape[0]})")
        stream = self.save_stream if (src.is_cuda and not dst.is_cuda) else self.load_stream
        with torch.cuda.stream(stream):
            if s.is_cuda:
                staged = s.index_select(0, si.to(self.device, non_blocking=True))  # gather on the GPU
            else:  # gather on the host into a pinned buffer, so that the copy across the bus is a DMA
                staged = torch.empty((n, row), dtype=torch.uint8, pin_memory=True)
                torch.index_select(s, 0, si, out=staged)
            if d.is_cuda:
                d.index_copy_(0, di.to(self.device, non_blocking=True), staged.to(self.device, non_blocking=True))
            else:  # device -> pinned host, then the scatter on the host once the bytes are there
                host = torch.empty((n, row), dtype=torch.uint8, pin_memory=True)
                host.copy_(staged, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        if not d.is_cuda:
            d.index_copy_(0, di, host)
        return n * row


def _rows_view(torch: Any, flat: Any, stride: int, row: int) -> Any:
    n = (flat.numel() - row) // stride + 1 if flat.numel() >= row else 0
    return torch.as_strided(flat, (n, row), (stride, 1))
