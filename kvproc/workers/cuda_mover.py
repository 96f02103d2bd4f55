"""The CUDA mover: rows between a GPU arena and pinned host memory (or two GPU arenas) on the copy worker's own
streams. NEVER RUN: written on a machine without a GPU; every test of it is skipped there (tests/workers).

It is the torch rows mover (`kvproc/workers/torch_mover.py`) with only the CUDA parts added: the batch contract, the
id checks (on the host, before any byte moves) and the gather / bulk copy / scatter shape are that mover's, and run
on CPU in every test run. What this class adds is `_move` alone: saves (device -> host) run on `save_stream`, loads
and device -> device copies on `load_stream`, never on the engine's compute stream; a host-side gather lands in a
pinned staging tensor, so that the copy across the bus is a DMA; a device -> host copy lands in pinned memory and is
scattered on the host once its event has completed. The buffers are flat uint8 torch tensors (a GPU arena from
`kvproc.ipc.cuda_ipc.open_arena`, a host segment as `torch.from_numpy` of a mapping pinned by
`kvproc.ipc.pinning.register`). `after(event)` makes the next batches wait on an event the engine recorded (the step
that wrote the pages); `rows` returns once its batch is done (it synchronises its own event), which is the CPU path's
contract: the engine-side event a load could signal instead is not written.
"""

from __future__ import annotations

from typing import Any

import torch

from kvproc.workers.movers import MoveError
from kvproc.workers.torch_mover import TorchRowsMover


class CudaMover(TorchRowsMover):
    name = "cuda"
    host_views = False

    def __init__(self, device: int = 0) -> None:
        if not torch.cuda.is_available():
            raise MoveError(f"the {self.name} mover needs a CUDA device; torch.cuda.is_available() is False")
        self.device = torch.device("cuda", device)
        self.save_stream = torch.cuda.Stream(self.device)
        self.load_stream = torch.cuda.Stream(self.device)

    def after(self, event: Any, saves: bool = True) -> None:
        """The next batches on that stream wait for `event` (recorded by the engine on its own stream)."""
        (self.save_stream if saves else self.load_stream).wait_event(event)

    def _move(self, d: torch.Tensor, di: torch.Tensor, s: torch.Tensor, si: torch.Tensor, n: int, row: int) -> Any:
        stream = self.save_stream if (s.is_cuda and not d.is_cuda) else self.load_stream
        host: torch.Tensor | None = None
        # what this thread queued before (a repack hook's output, on its current stream) lands before the batch reads
        # it; the engine's own writes are ordered by `after(event)` instead
        stream.wait_stream(torch.cuda.current_stream(self.device))
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
        if host is not None:
            d.index_copy_(0, di, host)
