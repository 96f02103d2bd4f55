"""The engine fence in the copy executors (`kvproc/workers/engine_fence.py`): an order that carries the engine's step
event (`after_event`) runs after it on a mover that can wait on CUDA events, and is refused whole, before a byte moves
or its save fence is claimed, on a mover that moves host memory. On CPU over both host movers (memmove, torch); the
waiting side through `_FencingMoverStub` (one side of the contract: the torch mover plus a `fenced` that records what
the cuda mover would wait on); the cuda mover's own `fenced` with CUDA only (skipped here)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from kvproc.ipc.orders import BoundedCopy, SaveOrder, SlotCopy
from kvproc.tiers import save_fence
from kvproc.tiers.layout import HostLayout
from kvproc.workers.copy_exec import CopyExecutor
from kvproc.workers.engine_fence import EngineEventError
from kvproc.workers.movers import MoveError, mover_for
from kvproc.workers.torch_mover import TorchRowsMover
from tests.workers.test_copy_exec import layout

HANDLE = bytes(range(64))
KINDS = pytest.mark.parametrize("kind", ["memmove", "torch"])
CUDA = torch.cuda.is_available()


def _executor(kind: str, stored: int | None = None, repack=None):  # type: ignore[no-untyped-def]
    lay = layout(stored=stored)
    hl = HostLayout.plan(lay, 1 << 16)
    host = np.zeros(hl.total_bytes, dtype=np.uint8)
    mover = _FencingMoverStub() if kind == "fencing" else mover_for("cpu", kind=kind)
    return lay, host, CopyExecutor(lay, host, hl, repack, mover=mover)


def _arena_bytes(lay) -> list[torch.Tensor]:  # type: ignore[no-untyped-def]
    return [a.byte_view().clone() for _, a in lay.arenas]


@KINDS
def test_a_save_carrying_an_engine_event_is_refused_whole_before_its_fence_is_claimed(kind: str) -> None:
    _, host, ex = _executor(kind)
    assert ex.fence_row is not None
    ex.fence_row[0] = 0  # the tier took this fence back: a claim would fail with FenceRevoked
    before = host.copy()
    order = SaveOrder("a", [0, 1], [2, 3], [BoundedCopy("st", 1, 0)], 0, 5, HANDLE)
    with pytest.raises(EngineEventError, match=r"save order of request 'a' carries an engine event handle") as e:
        ex.save(order)
    assert e.value.code == "event_unsupported"  # the event was looked at first: not FenceRevoked
    assert np.array_equal(host, before)  # no byte written
    with pytest.raises(save_fence.FenceRevoked):  # the same order without the event goes on to its fence
        ex.save(SaveOrder("a", [0, 1], [2, 3], [BoundedCopy("st", 1, 0)], 0, 5))
    assert ex.save(SaveOrder("a", [0, 1], [2, 3])) > 0  # and an unfenced one copies


@KINDS
def test_a_device_copy_carrying_an_engine_event_is_refused_whole(kind: str) -> None:
    lay, _, ex = _executor(kind)
    before = _arena_bytes(lay)
    with pytest.raises(EngineEventError, match=r"device copy of 1 slot\(s\) carries an engine event") as e:
        ex.device_copy([SlotCopy("st", 0, 3)], HANDLE)
    assert e.value.code == "event_unsupported"
    assert all(torch.equal(x, y) for x, y in zip(before, _arena_bytes(lay)))
    assert ex.device_copy([SlotCopy("st", 0, 3)]) == 16


class _FencingMoverStub(TorchRowsMover):
    """The torch mover with a `fenced` (test only, one side of the contract): records each (handle, saves) it was
    asked to wait on, and whether every batch moved inside one, as the cuda mover runs them on the waited stream."""

    name = "fencing-stub"

    def __init__(self, fail: bool = False) -> None:
        self.waits: list[tuple[bytes, bool]] = []
        self.inside: list[bool] = []
        self._in = False
        self.fail = fail

    @contextlib.contextmanager
    def fenced(self, handle: bytes, saves: bool) -> Iterator[None]:
        if self.fail:
            raise MoveError("cannot open the engine's CUDA IPC event handle on cuda:0: invalid resource handle")
        self.waits.append((handle, saves))
        self._in = True
        try:
            yield
        finally:
            self._in = False

    def _move(self, d, di, s, si, n, row):  # type: ignore[no-untyped-def]
        self.inside.append(self._in)
        return super()._move(d, di, s, si, n, row)


def test_on_a_mover_that_waits_every_batch_of_the_order_runs_after_the_engine_event() -> None:
    _, _, ex = _executor("fencing")
    mover = ex.mover
    assert ex.save(SaveOrder("a", [0, 1, 5], [2, 3, 4], [BoundedCopy("st", 1, 0)], after_event=HANDLE)) > 0
    assert mover.waits == [(HANDLE, True)] and mover.inside and all(mover.inside)  # the save stream
    mover.inside.clear()
    assert ex.device_copy([SlotCopy("st", 0, 3)], HANDLE) == 16
    assert mover.waits[-1] == (HANDLE, False) and mover.inside == [True]  # a device copy: the load stream
    mover.inside.clear()
    ex.save(SaveOrder("b", [2], [6]))  # no event: no wait
    assert len(mover.waits) == 2 and mover.inside and not any(mover.inside)


def test_a_repacked_saves_device_side_gather_waits_too() -> None:
    """The repack batches gather on the device first (device -> device): inside the fence like the rest."""
    def wide(group, direction, src, dst, arena):  # type: ignore[no-untyped-def]
        dst.zero_()
        dst[:, : src.shape[1]] = src if src.shape[1] <= dst.shape[1] else src[:, : dst.shape[1]]

    _, _, ex = _executor("fencing", stored=40, repack=wide)
    ex.save(SaveOrder("a", [0, 1], [2, 3], after_event=HANDLE))
    assert ex.mover.waits == [(HANDLE, True)] and len(ex.mover.inside) >= 3 and all(ex.mover.inside)


def test_a_handle_the_mover_cannot_open_refuses_the_order_as_bad_event() -> None:
    _, host, ex = _executor("fencing")
    ex.mover.fail = True
    before = host.copy()
    with pytest.raises(EngineEventError, match="invalid resource handle") as e:
        ex.save(SaveOrder("a", [0], [2], after_event=HANDLE))
    assert e.value.code == "bad_event" and np.array_equal(host, before) and ex.mover.inside == []


@pytest.mark.skipif(not CUDA, reason="no CUDA device (torch.cuda.is_available() is False): the cuda mover's fenced "
                                     "(opening an engine's IPC event, the stream wait) has never run")
def test_the_cuda_mover_waits_on_an_interprocess_event_on_its_save_stream() -> None:
    """NEVER RUN. The event comes from another process (a CUDA IPC event handle cannot be relied on to open in the
    process that made it): a child records it after a long kernel; the worker side opens it once per handle."""
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_record_event_child, args=(child,))
    proc.start()
    try:
        handle = parent.recv()
        mv = mover_for("cuda:0")
        dev = torch.randint(0, 255, (8 * 64,), dtype=torch.uint8, device="cuda:0")
        host = torch.zeros(8 * 64, dtype=torch.uint8).pin_memory()
        with mv.fenced(handle, True):
            assert mv.rows(host, 64, [0, 1], dev, 64, [2, 3], 64, 0) == 128
        with mv.fenced(handle, True):  # the same handle again: opened once
            mv.rows(host, 64, [2], dev, 64, [4], 64, 0)
        assert mv.events.opened == 1
        assert torch.equal(host.view(8, 64)[[0, 1, 2]], dev.view(8, 64)[[2, 3, 4]].cpu())
        parent.send("done")
    finally:
        proc.join(30)


def _record_event_child(conn) -> None:  # type: ignore[no-untyped-def]
    ev = torch.cuda.Event(interprocess=True)
    torch.cuda._sleep(100_000_000)  # a long kernel on this process's stream: the wait is real
    ev.record()
    conn.send(bytes(ev.ipc_handle()))
    conn.recv()  # keep the event alive until the other side is done
