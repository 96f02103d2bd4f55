"""The reference engine's step fence on a GPU: a small ring of interprocess CUDA events, one recorded after each step
on the model's stream, whose latest handle is what the store's `step_fence` returns (`KvStore(step_fence=)`). The copy
worker's stream waits on that event before it reads the pages the step wrote, so a save never copies a block the
step's kernels are still writing, and the engine's step never waits for a save.

A ring, not one event: the worker opens each handle once and keeps it (`kvproc.ipc.cuda_ipc.EventCache`), so the
engine reuses a few events instead of creating one per step. Re-recording an event a save has not waited on yet is
safe: a stream waits on the event's latest record, a later step on the same stream, which only waits longer.

On the CPU there is no ring and no fence (`step_fence_of` returns None: the store then makes no call at all).
NEVER RUN with CUDA (no GPU where it was written): `StepEvents` itself; tests/engine/test_step_events.py runs the
CPU side and skips the CUDA test without CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvproc.store.types import StepFence

if TYPE_CHECKING:
    from kvproc.engine.models import TinyModel

RING = 4


class StepEvents:
    """`RING` interprocess events on one CUDA device, recorded in turn; `latest` is the handle of the last one."""

    def __init__(self, device: torch.device, size: int = RING) -> None:
        if device.type != "cuda":
            raise ValueError(f"step events are CUDA events; the model runs on {device}")
        self.device = device
        self._events = [torch.cuda.Event(interprocess=True) for _ in range(size)]  # timing off, as IPC requires
        self._handles: list[bytes | None] = [None] * size  # each event's handle, asked once (after its first record)
        self._next = 0
        self.latest: bytes | None = None  # None until the first step
        self.recorded = 0

    def record(self) -> bytes:
        """After a step: record the next event of the ring on the device's current stream (the one the step ran
        on); returns its handle."""
        i = self._next
        ev = self._events[i]
        ev.record(torch.cuda.current_stream(self.device))
        handle = self._handles[i]
        if handle is None:
            handle = self._handles[i] = bytes(ev.ipc_handle())
        self._next = (i + 1) % len(self._events)
        self.latest = handle
        self.recorded += 1
        return handle


def step_fence_of(models: Sequence[TinyModel]) -> StepFence | None:
    """The store's `step_fence` for an engine running these per-rank models (`rank_models`): rank r's latest step
    event; None when they run on the CPU (no fence, no call)."""
    if all(getattr(m, "step_events", None) is None for m in models):
        return None
    ranks = list(models)

    def fence(rank: int) -> bytes | None:
        events = getattr(ranks[rank], "step_events", None)
        return events.latest if events is not None else None

    return fence
