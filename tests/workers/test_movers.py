"""Movers: which one `mover_for` picks, that each CPU mover moves exactly the named rows, and that the copy
executor's bytes go through its mover (a counting wrapper shows it)."""

import os

import numpy as np
import pytest
import torch

from kvproc.ipc.orders import BoundedCopy, LoadOrder, SaveOrder, SlotCopy
from kvproc.tiers.layout import HostLayout
from kvproc.workers import movers
from kvproc.workers.copy_exec import CopyError, CopyExecutor
from kvproc.workers.movers import MEMMOVE, CmaRowsMover, MoveError, RemoteMemory, mover_for
from kvproc.workers.tensor_exec import TensorCopyExecutor
from kvproc.workers.torch_mover import TORCH
from tests.workers.test_copy_exec import block, layout


def test_mover_for_picks_memmove_on_cpu_and_cma_for_another_process():
    assert mover_for("cpu") is MEMMOVE
    assert isinstance(mover_for(engine_pid=os.getpid()), CmaRowsMover)
    with pytest.raises(MoveError, match="CUDA IPC"):
        mover_for("cuda:0", engine_pid=os.getpid())
    with pytest.raises(MoveError, match="no mover"):
        mover_for("mps")


def _bufs(rows=6, stride=24, row=16):
    rng = np.random.default_rng(1)
    return rng.integers(0, 255, rows * stride, dtype=np.uint8), np.zeros(rows * stride, dtype=np.uint8)


@pytest.mark.parametrize("native", [True, False])
def test_memmove_rows_copies_exactly_the_named_rows_and_checks_ids_first(monkeypatch, native):
    if not native:
        monkeypatch.setattr(movers, "NATIVE", None)  # the numpy fallback
    elif movers.NATIVE is None:
        pytest.skip("kvproc.native is not built")
    src, dst = _bufs()
    assert MEMMOVE.rows(dst, 24, [5, 0, 1], src, 24, [0, 3, 4], 16, 0) == 48
    for d, s in ((5, 0), (0, 3), (1, 4)):
        assert np.array_equal(dst[d * 24 : d * 24 + 16], src[s * 24 : s * 24 + 16])
    assert not dst[2 * 24 : 5 * 24].any() and not dst[5 * 24 + 16 :].any()  # padding and other rows untouched
    before = dst.copy()
    with pytest.raises(MoveError):
        MEMMOVE.rows(dst, 24, [0, 6], src, 24, [1, 2], 16, 0)
    assert np.array_equal(dst, before)  # nothing half-applied


def test_cma_rows_moves_both_ways_through_this_process_as_the_other_side():
    """This process plays the engine (its own pid: same user, always permitted)."""
    src, dst = _bufs()
    mv = mover_for(engine_pid=os.getpid())
    there = RemoteMemory(os.getpid(), src.ctypes.data)
    assert mv.rows(dst.ctypes.data, 24, [2, 3], there, 24, [4, 1], 16, 0) == 32  # read
    assert np.array_equal(dst[48:64], src[96:112]) and np.array_equal(dst[72:88], src[24:40])
    back = np.zeros_like(src)
    assert mv.rows(RemoteMemory(os.getpid(), back.ctypes.data), 24, [0], dst.ctypes.data, 24, [2], 16, 0) == 16
    assert np.array_equal(back[:16], src[96:112])
    with pytest.raises(MoveError, match="exactly one"):
        mv.rows(dst.ctypes.data, 24, [0], src.ctypes.data, 24, [0], 16, 0)


class CountingMover:
    """A mover wrapper for this test: counts the batches it is asked to move, moves them with memmove."""

    name, host_views = "counting", True

    def __init__(self):
        self.calls = 0

    def rows(self, *args):
        self.calls += 1
        return MEMMOVE.rows(*args)


@pytest.mark.skipif(movers.NATIVE is None, reason="the executor asks its mover where kvproc.native is built")
def test_executor_moves_pages_through_its_mover_and_names_it():
    lay = layout()
    hl = HostLayout.plan(lay, 1 << 16)
    mv = CountingMover()
    ex = CopyExecutor(lay, np.zeros(hl.total_bytes, dtype=np.uint8), hl, mover=mv)
    before = {a.name: [block(a, i).clone() for i in range(a.num_blocks)] for _, a in lay.arenas}
    ex.save(SaveOrder("r", [0, 2], [1, 3], []))
    ex.load(LoadOrder("r", [1, 3], [5, 6], []))
    assert mv.calls == 4  # one batch per paged arena per order: no per-block call
    k0 = next(a for _, a in lay.arenas if a.name == "k0")
    assert (block(k0, 5) == before["k0"][0]).all() and (block(k0, 6) == before["k0"][2]).all()
    assert ex.mover_name("save") == "counting" and ex.mover_name("engine") == "cma"
    assert CopyExecutor(lay).mover_name("load") == "memmove"


class CountingTorchMover(CountingMover):
    """The same wrapper around the torch mover: an executor over it is the tensor executor (no host views)."""

    name, host_views = "counting-torch", False

    def rows(self, *args):
        self.calls += 1
        return TORCH.rows(*args)


def test_a_mover_without_host_views_gets_the_tensor_executor_and_one_batch_per_arena_and_order():
    """Scattered pages, bounded slots and a device copy: one `rows` call per arena per order, whatever the blocks
    (no per-block call), the same bytes as the memmove executor's."""
    lay, ref = layout(nb=32), layout(nb=32)
    for (_, a), (_, b) in zip(lay.arenas, ref.arenas):
        b.tensor.copy_(a.tensor)
    hl = HostLayout.plan(lay, 1 << 16)
    mv = CountingTorchMover()
    ex = CopyExecutor(lay, np.zeros(hl.total_bytes, dtype=np.uint8), hl, mover=mv)
    other = CopyExecutor(ref, np.zeros(hl.total_bytes, dtype=np.uint8), hl)
    assert isinstance(ex, TensorCopyExecutor) and type(other) is CopyExecutor
    ids, slots, dest = [9, 0, 31, 4, 5, 6, 7, 20], [3, 8, 1, 11, 12, 13, 14, 0], [1, 2, 3, 10, 11, 12, 13, 30]
    for e in (ex, other):
        e.save(SaveOrder("r", ids, slots, [BoundedCopy("st", 1, 0), BoundedCopy("st", 3, 1)]))
        e.load(LoadOrder("r", slots, dest, [BoundedCopy("st", 0, 2), BoundedCopy("st", 1, 0)]))
        e.device_copy([SlotCopy("st", 2, 3), SlotCopy("st", 0, 1)])
    assert mv.calls == 3 + 3 + 1  # per order: k0, k1 and s0 (the one bounded arena)
    for (_, a), (_, b) in zip(lay.arenas, ref.arenas):
        assert torch.equal(a.tensor, b.tensor), a.name
    assert ex.mover_name("save") == "counting-torch" and ex.mover_name("engine") == "cma"


@pytest.mark.parametrize("kind", ["memmove", "torch"])
def test_an_engine_move_reaches_either_executors_arenas_by_address(kind):
    """`EngineMove` (this process plays the engine): blocks out to its private memory and back, through the cma
    mover, whichever mover the executor's own orders use; a block past the arena is refused."""
    lay = layout()
    ex = CopyExecutor(lay, mover=mover_for("cpu", kind=kind))
    k1 = next(a for _, a in lay.arenas if a.name == "k1")
    before = [block(k1, i).clone() for i in range(k1.num_blocks)]
    engine = np.zeros(k1.num_blocks * 32, dtype=np.uint8)
    assert ex.engine_move(os.getpid(), True, ["k1"], [engine.ctypes.data], 32, 32, [0, 3], [5, 2]) == 64
    assert np.array_equal(engine[:32], before[5].numpy()) and np.array_equal(engine[96:128], before[2].numpy())
    k1.byte_view().zero_()
    assert ex.engine_move(os.getpid(), False, ["k1"], [engine.ctypes.data], 32, 32, [3], [6]) == 32
    assert torch.equal(block(k1, 6), before[2]) and not block(k1, 5).any()
    with pytest.raises(CopyError, match="has 8 blocks"):
        ex.engine_move(os.getpid(), False, ["k1"], [engine.ctypes.data], 32, 32, [0], [8])
