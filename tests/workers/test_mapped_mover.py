"""The mapped CUDA mover (`cuda_mapped`): what runs on CPU (its selection and refusals, its checks being the torch
mover's, the widened row views it moves and the `__cuda_array_interface__` it describes host rows with) and its GPU
round trips, skipped without CUDA (never run: no GPU where it was written)."""

import mmap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproc.ipc import pinning
from kvproc.workers.cuda_mover import CudaMover
from kvproc.workers.mapped_mover import HostRows, MappedMover, element_bytes, widen
from kvproc.workers.movers import MEMMOVE, MoveError, mover_for
from kvproc.workers.torch_mover import TorchRowsMover, rows_view

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device (torch.cuda.is_available() is False): the mapped "
                                                 "mover has never run")


def test_the_mapped_mover_shares_every_check_and_replaces_only_the_move():
    """What makes the CPU tests cover it: `rows` (ids, lengths, ranges) is the torch mover's, streams and `after` the
    cuda mover's; it adds a name and `_move`."""
    assert issubclass(MappedMover, CudaMover) and issubclass(MappedMover, TorchRowsMover)
    assert MappedMover.rows is TorchRowsMover.rows and MappedMover.after is CudaMover.after
    assert {k for k in vars(MappedMover) if not k.startswith("__")} == {"name", "_move"}
    assert MappedMover.name == "cuda_mapped" and MappedMover.host_views is False


@pytest.mark.skipif(CUDA, reason="the CPU-only refusals")
def test_without_cuda_the_mapped_mover_is_a_clear_error():
    with pytest.raises(MoveError, match="the cuda_mapped mover needs a CUDA device"):
        mover_for("cuda:0", kind="cuda_mapped")
    with pytest.raises(MoveError, match="the cuda mover needs a CUDA device"):
        mover_for("cuda", kind="cuda")
    for kind in ("cuda", "cuda_mapped"):  # asked for CPU buffers: refused whether or not CUDA is there
        with pytest.raises(MoveError, match=f"the {kind} mover moves between a CUDA device .* 'cpu' is not a CUDA"):
            mover_for("cpu", kind=kind)


def _buffers(data, row):
    """Two flat byte buffers, each a (rows, row) view at a drawn stride and start offset."""
    out = []
    for _ in range(2):
        stride = row + data.draw(st.sampled_from([0, 1, 3, 8, 16]))
        rows, start = data.draw(st.integers(1, 12)), data.draw(st.sampled_from([0, 1, 2, 4, 8, 24]))
        flat = np.random.default_rng(data.draw(st.integers(0, 1 << 20))).integers(
            0, 256, start + (rows - 1) * stride + row, dtype=np.uint8)
        out.append((flat, start, stride, rows))
    return out


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_widened_views_move_exactly_the_bytes_memmove_moves(data):
    """The mover's element width (8, 4, 2 or 1 bytes, from the row, strides, offsets and addresses) views the same
    memory (no copy) and its gather / scatter writes exactly memmove's bytes, padding and offsets untouched. On CPU
    tensors: the kernels are the same ops the GPU runs."""
    row = data.draw(st.sampled_from([1, 2, 3, 4, 6, 8, 12, 16, 24, 40, 64]))
    (dflat, dstart, dstride, nd), (sflat, sstart, sstride, ns) = _buffers(data, row)
    n = data.draw(st.integers(1, min(nd, 6)))
    di = data.draw(st.lists(st.integers(0, nd - 1), min_size=n, max_size=n, unique=True))
    si = data.draw(st.lists(st.integers(0, ns - 1), min_size=n, max_size=n))
    want = dflat.copy()
    MEMMOVE.rows(want[dstart:], dstride, di, sflat[sstart:], sstride, si, row, 0)
    dt = torch.from_numpy(dflat.copy())
    d, s = rows_view(dt[dstart:], dstride, row), rows_view(torch.from_numpy(sflat)[sstart:], sstride, row)
    width = element_bytes(row, d, s)
    aligned = all(x % 8 == 0 for x in (row, dstride, sstride, dstart, sstart, d.data_ptr(), s.data_ptr()))
    assert width == 8 if aligned else width in (1, 2, 4, 8)
    wd, ws = widen(d, width), widen(s, width)
    assert wd.data_ptr() == d.data_ptr() and ws.data_ptr() == s.data_ptr() and wd.element_size() == width
    wd.index_copy_(0, torch.tensor(di), ws.index_select(0, torch.tensor(si)))
    assert np.array_equal(dt.numpy(), want)


class _ArrayInterface:
    """numpy's view of what `HostRows` tells CUDA consumers (the same keys and meaning, for host memory)."""

    def __init__(self, cai):
        self.__array_interface__ = {k: cai[k] for k in ("shape", "strides", "typestr", "data")} | {"version": 3}


@pytest.mark.parametrize("width", [1, 2, 4, 8])
def test_the_cuda_array_interface_describes_exactly_the_host_rows(width):
    """Address, shape, byte strides and type of a strided rows view (what `torch.as_tensor(..., device=)` maps):
    read back through numpy's twin of the interface, it aliases those rows and no other byte."""
    flat = torch.zeros(4096, dtype=torch.uint8)
    rows = widen(rows_view(flat[64:], 48, 16), width)
    cai = HostRows(rows).__cuda_array_interface__
    assert cai["data"] == (rows.data_ptr(), False) and cai["version"] == 3 and cai["stream"] is None
    arr = np.asarray(_ArrayInterface(cai))
    assert arr.shape == tuple(rows.shape) and arr.strides == (48, width) and arr.itemsize == width
    arr[:] = -1 if width > 1 else 255  # every byte of every row
    view = flat.numpy()[64:]
    assert all(view[i * 48 : i * 48 + 16].tolist() == [255] * 16 for i in range(rows.shape[0]))
    assert not view[16:48].any() and not flat.numpy()[:64].any()  # the padding and what lies before: untouched


class _CudartStub:
    """One side of the contract: records what `pinning` asks of the CUDA runtime, answers `status`."""

    def __init__(self, status=0):
        self.calls, self.status = [], status

    def cudaHostRegister(self, address, nbytes, flags):  # the runtime's names
        self.calls.append(("register", address, nbytes, flags))
        return self.status

    def cudaHostUnregister(self, address):
        self.calls.append(("unregister", address))
        return self.status

    def cudaGetErrorString(self, err):
        return "invalid argument"


def test_a_segment_is_registered_portable_and_mapped_with_a_stub_cudart(monkeypatch):
    """What the mapped mover needs of the pin: cudaHostRegister(address, size, portable | mapped = 3), and
    cudaHostUnregister before unmap; a failure is a PinError naming the segment. The real runtime never ran here."""
    from kvproc.ipc.segment import Segment

    stub = _CudartStub()
    monkeypatch.setattr(pinning, "_cuda_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: stub)
    with Segment.create("pinstub", "copy_worker", 1 << 16) as seg:
        assert pinning.register(seg) is True and seg.pinned
        address = seg.address()
        seg.close()
        assert not seg.pinned
    assert stub.calls == [("register", address, 1 << 16, 3), ("unregister", address)]
    stub.status = 1
    with Segment.create("pinstub", "copy_worker", 1 << 12) as seg:
        with pytest.raises(pinning.PinError, match=r"cudaHostRegister\(.*pinstub.*4096 B\) failed: CUDA error 1 "
                                                   r"\(invalid argument\)"):
            pinning.register(seg)
        assert not seg.pinned


def _registered(nbytes):
    buf = np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)
    pinning.register_address(buf.ctypes.data, buf.nbytes, "a test buffer")
    return buf


@needs_cuda
def test_mapped_mover_round_trips_scattered_rows_through_registered_host_memory():
    """NEVER RUN. A registered anonymous mapping (as a copy worker's segment is), rows at odd strides: a save and a
    load land exactly where the memmove mover puts them; memory nobody registered is refused before any byte moves."""
    mv = mover_for("cuda:0", kind="cuda_mapped")
    dev = torch.randint(0, 255, (16 * 96,), dtype=torch.uint8, device="cuda:0")
    buf = _registered(1 << 16)
    try:
        host = torch.from_numpy(buf)
        for row, hstride in ((64, 64), (40, 72), (13, 29)):  # 8-byte, 8-byte at a wider stride, 1-byte elements
            host.zero_()
            assert mv.rows(host, hstride, [3, 0, 9], dev, 96, [1, 7, 8], row, 0) == 3 * row  # save
            want = np.zeros_like(buf)
            MEMMOVE.rows(want, hstride, [3, 0, 9], dev.cpu().numpy(), 96, [1, 7, 8], row, 0)
            assert np.array_equal(buf, want)
            back = torch.zeros_like(dev)
            assert mv.rows(back, 96, [1, 7, 8], host, hstride, [3, 0, 9], row, 0) == 3 * row  # load
            assert torch.equal(back.view(16, 96)[[1, 7, 8], :row], dev.view(16, 96)[[1, 7, 8], :row])
            assert not back.view(16, 96)[[0, 2], :].any()
        plain = torch.zeros(1 << 12, dtype=torch.uint8)  # never registered
        with pytest.raises(MoveError, match="not pinned"):
            mv.rows(plain, 64, [0], dev, 96, [1], 64, 0)
        assert not plain.any()
    finally:
        pinning.unregister_address(buf.ctypes.data, "a test buffer")


@needs_cuda
def test_mapped_mover_moves_rows_within_the_device_and_with_torch_pinned_memory():
    """NEVER RUN. Device to device (seal-by-copy) and torch's own pinned tensors (cudaHostAlloc) as the host side."""
    mv = mover_for("cuda:0", kind="cuda_mapped")
    dev = torch.arange(8 * 64, dtype=torch.int64, device="cuda:0").to(torch.uint8)
    old = dev.clone().view(8, 64)
    mv.rows(dev, 64, [2, 3], dev, 64, [1, 2], 64, 0)  # rows move as they were before the batch
    assert torch.equal(dev.view(8, 64)[2], old[1]) and torch.equal(dev.view(8, 64)[3], old[2])
    host = torch.zeros(8 * 64, dtype=torch.uint8).pin_memory()
    mv.rows(host, 64, [5, 0], dev, 64, [0, 7], 64, 0)
    assert torch.equal(host.view(8, 64)[[5, 0]], dev.view(8, 64)[[0, 7]].cpu())


@needs_cuda
@pytest.mark.parametrize("model", ["dense", "mla", "hybrid", "swa"])
def test_every_model_round_trips_through_the_executor_over_the_mapped_mover(model):
    """NEVER RUN. `kvproc bench gpu`'s round trip (save, clear, load elsewhere, bit-exact) over the mapped mover."""
    from kvproc.bench.gpu_check import round_trip

    rows = round_trip(model, 8, "cuda:0", "cuda_mapped")
    assert [r["mover"] for r in rows] == ["cuda_mapped"] and all(r["ok"] for r in rows), rows
