"""The torch rows mover (the GPU path's batch logic) on CPU tensors: the same rows as the memmove mover for any
batch, ids checked before any byte moves, and the CUDA mover adding nothing but its `_move`."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproc.workers.cuda_mover import CudaMover
from kvproc.workers.movers import MEMMOVE, MoveError, mover_for
from kvproc.workers.torch_mover import TorchRowsMover


def test_mover_for_gives_the_torch_mover_on_cpu_only_when_asked():
    assert mover_for("cpu") is MEMMOVE and mover_for("cpu", kind="memmove") is MEMMOVE
    mv = mover_for("cpu", kind="torch")
    assert isinstance(mv, TorchRowsMover) and mv.name == "torch" and not mv.host_views
    with pytest.raises(MoveError, match="no mover kind"):
        mover_for("cpu", kind="cuda-ish")


def test_the_cuda_mover_shares_every_check_and_replaces_only_the_move():
    """What makes the CPU tests cover the GPU path: `rows` (ids, lengths, ranges) is the torch mover's own."""
    assert issubclass(CudaMover, TorchRowsMover)
    assert CudaMover.rows is TorchRowsMover.rows
    # besides `_move`, only the waits on an engine's event (`after`, and `fenced`, which the executor calls around an
    # order that carries one: `kvproc/workers/engine_fence.py`, exercised on CPU through a stub fencing mover) and
    # `_stream`, the stream a batch runs on (a fenced order's, else by direction; shared with the mapped mover)
    assert {k for k in vars(CudaMover) if not k.startswith("__")} == {"name", "host_views", "after", "fenced",
                                                                       "_stream", "_move"}


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_torch_rows_land_exactly_where_memmove_puts_them(data):
    """Any stride, row size and batch (ids in any order, distinct destinations): the torch mover writes the same
    bytes as the memmove mover, padding between rows included (never written)."""
    row = data.draw(st.integers(1, 40))
    dst_stride, src_stride = row + data.draw(st.integers(0, 9)), row + data.draw(st.integers(0, 9))
    nd, ns = data.draw(st.integers(1, 24)), data.draw(st.integers(1, 24))
    n = data.draw(st.integers(0, min(nd, 16)))
    dst_ids = data.draw(st.lists(st.integers(0, nd - 1), min_size=n, max_size=n, unique=True))
    src_ids = data.draw(st.lists(st.integers(0, ns - 1), min_size=n, max_size=n))
    rng = np.random.default_rng(data.draw(st.integers(0, 1 << 30)))
    src = rng.integers(0, 256, (ns - 1) * src_stride + row, dtype=np.uint8)
    dst = rng.integers(0, 256, (nd - 1) * dst_stride + row, dtype=np.uint8)
    want = dst.copy()
    assert MEMMOVE.rows(want, dst_stride, dst_ids, src, src_stride, src_ids, row, 0) == n * row
    got = torch.from_numpy(dst.copy())
    ids = data.draw(st.sampled_from(["list", "numpy", "tensor"]))
    conv = {"list": list, "numpy": np.asarray, "tensor": torch.tensor}[ids]
    moved = TorchRowsMover().rows(got, dst_stride, conv(dst_ids) if n else [], torch.from_numpy(src), src_stride,
                                  conv(src_ids) if n else [], row, 0)
    assert moved == n * row
    assert np.array_equal(got.numpy(), want)


def test_bad_ids_or_lengths_refuse_the_whole_batch_before_any_byte_moves():
    src = torch.arange(6 * 24, dtype=torch.uint8)
    dst = torch.zeros(6 * 24, dtype=torch.uint8)
    mv = TorchRowsMover()
    for dst_ids, src_ids in (([0, 6], [1, 2]), ([0, 1], [5, 6]), ([0, -1], [1, 2]), ([0], [1, 2])):
        with pytest.raises(MoveError):
            mv.rows(dst, 24, dst_ids, src, 24, src_ids, 16, 0)
        assert not dst.any()  # nothing half-applied
    assert mv.rows(dst, 24, [], src, 24, [], 16, 0) == 0


def test_a_batch_within_one_buffer_moves_the_rows_as_they_were_before_it():
    """The gather completes before the scatter: row 1 -> 2 and row 2 -> 3 in one batch copies the old row 2."""
    buf = torch.arange(4 * 8, dtype=torch.uint8)
    old = buf.clone().view(4, 8)
    TorchRowsMover().rows(buf, 8, [2, 3], buf, 8, [1, 2], 8, 0)
    assert torch.equal(buf.view(4, 8)[2], old[1]) and torch.equal(buf.view(4, 8)[3], old[2])
