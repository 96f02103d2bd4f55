"""The CUDA mover, CUDA IPC and pinning on a GPU. Every test here is skipped without CUDA (this file has never run
its GPU tests: no GPU where it was written); `check_geometry` and the CPU-only pinning no-op run everywhere."""

import numpy as np
import pytest
import torch

from kvproc.ipc import messages as m
from kvproc.ipc import pinning
from kvproc.ipc.cuda_ipc import CudaArenaHandle, CudaIpcError, check_geometry
from kvproc.ipc.segment import Segment
from kvproc.workers.movers import MoveError, mover_for

CLUSTER = "cudatest"
CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device (torch.cuda.is_available() is False)")


def _handle(**kw):
    base = {"name": "k0", "ipc": m.CudaIpcRef(0, b"", 1000, 0, b"", 0, b"", False), "offset": 100, "num_blocks": 4,
            "bytes_per_block": 200, "block_stride": 220}
    base.update(kw)
    return CudaArenaHandle(**base)


def test_an_arena_handle_is_checked_before_it_is_opened():
    check_geometry(_handle(), 0)  # 100 + 3 * 220 + 200 = 960 <= 1000
    with pytest.raises(CudaIpcError, match="bound to cuda:1"):
        check_geometry(_handle(), 1)
    with pytest.raises(CudaIpcError, match="outside"):
        check_geometry(_handle(offset=141), 0)  # 1001 > 1000
    with pytest.raises(CudaIpcError, match="geometry"):
        check_geometry(_handle(block_stride=100), 0)


@pytest.mark.skipif(CUDA, reason="the CPU-only behaviour")
def test_without_cuda_pinning_is_a_no_op_and_the_cuda_mover_refuses_to_start():
    with Segment.create(CLUSTER, "copy_worker", 1 << 16) as seg:
        assert pinning.register(seg) is False and not seg.pinned
    with pytest.raises(MoveError, match="CUDA"):
        mover_for("cuda:0")


@needs_cuda
def test_cuda_mover_round_trips_scattered_rows_through_pinned_host_memory():
    mv = mover_for("cuda:0")
    dev = torch.randint(0, 255, (16 * 96,), dtype=torch.uint8, device="cuda:0")
    host = torch.zeros(16 * 64, dtype=torch.uint8).pin_memory()
    assert mv.rows(host, 64, [3, 0, 9], dev, 96, [1, 7, 8], 64, 0) == 192  # save: device -> host
    back = torch.zeros_like(dev)
    assert mv.rows(back, 96, [1, 7, 8], host, 64, [3, 0, 9], 64, 0) == 192  # load: host -> device
    rows = dev.view(16, 96)[:, :64]
    assert torch.equal(back.view(16, 96)[[1, 7, 8], :64], rows[[1, 7, 8]])
    assert not back.view(16, 96)[[0, 2], :].any()


@needs_cuda
def test_a_segment_pins_and_unpins_before_unmap():
    with Segment.create(CLUSTER, "copy_worker", 1 << 20) as seg:
        assert pinning.register(seg) is True and seg.pinned
        seg.close()
        assert not seg.pinned


@needs_cuda
def test_cuda_ipc_opens_an_arena_in_another_process():
    import torch.multiprocessing as tmp

    from kvproc.ipc.cuda_ipc import export_arena

    arena = torch.arange(4 * 256, dtype=torch.int32, device="cuda:0").view(torch.uint8)
    h = export_arena("k0", arena, 4, 1024, 1024)
    ctx = tmp.get_context("spawn")
    with ctx.Pool(1) as pool:
        assert pool.apply(_sum_in_child, (h,)) == int(arena.sum())


def _sum_in_child(h):
    from kvproc.ipc.cuda_ipc import open_arena

    return int(open_arena(h, 0).sum())


def test_numpy_segment_views_feed_torch_without_a_copy():
    """What the CUDA mover's host side is: `torch.from_numpy` of the mapping (runs on CPU)."""
    with Segment.create(CLUSTER, "copy_worker", 1 << 12) as seg:
        v = seg.numpy()
        t = torch.from_numpy(v)
        t[:4] = 7
        assert np.all(v[:4] == 7)
        del v, t
