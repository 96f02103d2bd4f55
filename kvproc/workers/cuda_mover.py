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

Ordering with the engine (issue 19): `fenced(handle, saves)` opens the engine's step event from its CUDA IPC handle
(cached: `kvproc.ipc.cuda_ipc.EventCache`), makes the order's stream wait on it on the GPU (`after`: never a CPU
wait), and runs every batch this thread moves inside it on that stream, the device-side gather of a repacked save
included (which would otherwise pick the load stream by direction and not wait).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from kvproc.ipc.cuda_ipc import CudaIpcError, EventCache
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
        self.events = EventCache(device)  # the engine's step events, opened once per handle
        self._order = threading.local()  # .stream: the stream a fenced order's batches run on (this thread's)

    def after(self, event: Any, saves: bool = True) -> None:
        """The next batches on that stream wait for `event` (recorded by the engine on its own stream)."""
        (self.save_stream if saves else self.load_stream).wait_event(event)

    @contextlib.contextmanager
    def fenced(self, handle: bytes, saves: bool) -> Iterator[None]:
        """Every batch this thread moves inside waits on the GPU for the engine's event `handle` (a CUDA IPC event
        handle): the save stream (`saves`) or the load stream (device copies) waits on it, and the order's batches
        all run on that stream. The wait is the stream's (`cudaStreamWaitEvent`), not a CPU wait on the engine's
        event and never a wait on the engine's side; the worker's thread then waits for its own batch, as for any
        batch (`rows` synchronises its own event), which now ends after the engine's step."""
        try:
            event = self.events.get(handle)
        except CudaIpcError as e:
            raise MoveError(str(e)) from None
        stream = self.save_stream if saves else self.load_stream
        self.after(event, saves)
        self._order.stream = stream
        try:
            yield
        finally:
            self._order.stream = None

    def _stream(self, d: torch.Tensor, s: torch.Tensor) -> Any:
        """The stream a batch runs on: a fenced order's (`fenced`), else by direction (device -> host: saves)."""
        stream = getattr(self._order, "stream", None)
        if stream is None:
            stream = self.save_stream if (s.is_cuda and not d.is_cuda) else self.load_stream
        return stream

    def _move(self, d: torch.Tensor, di: torch.Tensor, s: torch.Tensor, si: torch.Tensor, n: int, row: int) -> Any:
        stream = self._stream(d, s)
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
