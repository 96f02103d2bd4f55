"""Movers: which one `mover_for` picks, that each CPU mover moves exactly the named rows, and that the copy
executor's bytes go through its mover (a counting wrapper shows it)."""

import os

import numpy as np
import pytest

from kvproc.ipc.orders import LoadOrder, SaveOrder
from kvproc.tiers.layout import HostLayout
from kvproc.workers import movers
from kvproc.workers.copy_exec import CopyError, CopyExecutor
from kvproc.workers.movers import MEMMOVE, CmaRowsMover, MoveError, RemoteMemory, mover_for
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


def test_executor_refuses_a_mover_without_host_views():
    class NoViews(CountingMover):
        name, host_views = "noviews", False

    with pytest.raises(CopyError, match="not wired"):
        CopyExecutor(layout(), mover=NoViews())
