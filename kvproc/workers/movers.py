"""Movers: the one interface a copy executor moves bytes through, and the one place that picks which mover runs.

A mover does one thing: `rows(dst, dst_stride, dst_ids, src, src_stride, src_ids, row, gil_bytes)` sets row
`dst_ids[i]` of `dst` (rows `dst_stride` bytes apart) to row `src_ids[i]` of `src`, `row` bytes each, for a whole
batch in one call, every id checked before any byte moves; it returns the bytes moved. Three kinds:

- `memmove`: both buffers are this process's memory (1-d uint8 numpy arrays): `kvproc.native`'s `copy_rows` (one
  memmove per run), or one numpy gather/scatter where the module is not built.
- `cma`: one side is another process's memory (`RemoteMemory`: pid + address), the other an address here:
  `process_vm_readv` / `process_vm_writev` (`kvproc/workers/cma.py`), up to 1,024 spans per system call.
- `torch`: 1-d uint8 torch tensors on any device, CPU included (`kvproc/workers/torch_mover.py`): one gather, one
  bulk copy, one scatter per batch. The CUDA mover's batch logic, run and tested on CPU (`mover_for("cpu",
  kind="torch")`); nothing picks it on CPU unless asked (memmove is the CPU hot path).
- `cuda`: the torch mover on its own CUDA streams with pinned staging (`kvproc/workers/cuda_mover.py`). NEVER RUN:
  written without a GPU, imported only when `mover_for` is asked for a CUDA device.
- `cuda_mapped`: the cuda mover with the pinned host segment mapped into the device, so that the GPU's gather and
  scatter kernels read and write host rows directly, no staging (`kvproc/workers/mapped_mover.py`). NEVER RUN;
  only when asked (`kind="cuda_mapped"`).

`CopyExecutor` asks `mover_for` once per attachment and names the mover in its counters (`mover.<name>`); nothing
else in kvproc knows which one runs. `host_views` says whether the mover's buffers are numpy views of this process's
memory, which the executor's planned CPU paths (slices, gathers, the repack hook's batches) need.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvproc.native import NATIVE
from kvproc.workers.cma import CmaError, CmaMover, block_spans


class MoveError(RuntimeError):
    """A batch could not be moved (an id out of range, a refused cross-memory transfer, a CUDA error)."""


class Mover(Protocol):
    name: str
    host_views: bool

    def rows(self, dst: Any, dst_stride: int, dst_ids: Sequence[int], src: Any, src_stride: int,
             src_ids: Sequence[int], row: int, gil_bytes: int) -> int: ...


class MemmoveMover:
    """This process's memory to this process's memory."""

    name = "memmove"
    host_views = True

    def rows(self, dst: np.ndarray, dst_stride: int, dst_ids: Sequence[int], src: np.ndarray, src_stride: int,
             src_ids: Sequence[int], row: int, gil_bytes: int) -> int:
        if NATIVE is not None:
            try:
                return int(NATIVE.copy_rows(dst, dst_stride, dst_ids, src, src_stride, src_ids, row, gil_bytes))
            except (IndexError, ValueError) as e:
                raise MoveError(str(e)) from None
        if len(dst_ids) != len(src_ids):
            raise MoveError(f"{len(dst_ids)} destination rows against {len(src_ids)} source rows")
        d, s = _row_view(dst, dst_stride, row), _row_view(src, src_stride, row)
        di, si = np.asarray(dst_ids, dtype=np.int64), np.asarray(src_ids, dtype=np.int64)
        if di.size and (di.min() < 0 or di.max() >= d.shape[0] or si.min() < 0 or si.max() >= s.shape[0]):
            raise MoveError(f"ids out of range (destination < {d.shape[0]}, source < {s.shape[0]})")
        d[di] = s[si]  # one gather and one scatter in C
        return int(di.size) * row


def _row_view(flat: np.ndarray, stride: int, row: int) -> np.ndarray:
    n = (flat.size - row) // stride + 1 if flat.size >= row else 0
    return np.lib.stride_tricks.as_strided(flat, (n, row), (stride, 1))


@dataclass(frozen=True)
class RemoteMemory:
    """Row 0 of a buffer in another process, by address (what an engine that allocated its own KV can name)."""

    pid: int
    base: int


class CmaRowsMover:
    """Another process's memory to an address here and back, by cross-memory attach. Exactly one side is a
    `RemoteMemory`; the other is an int address in this process (the caller checked its ids against its arena)."""

    name = "cma"
    host_views = False

    def __init__(self, pid: int) -> None:
        self._mover = CmaMover(pid)

    def rows(self, dst: RemoteMemory | int, dst_stride: int, dst_ids: Sequence[int], src: RemoteMemory | int,
             src_stride: int, src_ids: Sequence[int], row: int, gil_bytes: int) -> int:
        try:
            if isinstance(dst, RemoteMemory) and isinstance(src, int):
                return self._mover.write(block_spans(dst.base, dst_ids, src, src_ids, row, dst_stride, src_stride))
            if isinstance(src, RemoteMemory) and isinstance(dst, int):
                return self._mover.read(block_spans(src.base, src_ids, dst, dst_ids, row, src_stride, dst_stride))
        except (CmaError, ValueError) as e:
            raise MoveError(str(e)) from None
        raise MoveError("a cross-memory move needs exactly one RemoteMemory side and one local address")


MEMMOVE = MemmoveMover()


MOVER_KINDS = ("", "memmove", "torch", "cuda", "cuda_mapped")  # what `kind` may ask for ("" = the device's default)
CUDA_MOVERS = ("cuda", "cuda_mapped")  # the movers whose host side must be pinned (`kvproc.ipc.pinning`)


def mover_for(device: str = "cpu", engine_pid: int | None = None, kind: str = "") -> Mover:
    """The mover for buffers on `device` ("cpu", "cuda", "cuda:N"), or, with `engine_pid`, for another process's
    CPU memory. `kind="torch"` asks for the torch rows mover on CPU (the GPU path's logic without CUDA); on a CUDA
    device the torch mover is the CUDA one ("", "torch" and "cuda" all name it), and `kind="cuda_mapped"` the mapped
    one. The only place that chooses."""
    if kind not in MOVER_KINDS:
        raise MoveError(f"no mover kind {kind!r} (one of {', '.join(repr(k) for k in MOVER_KINDS)})")
    if engine_pid is not None:
        if device != "cpu":
            raise MoveError("an engine's GPU memory is opened by CUDA IPC at attach (kvproc/ipc/cuda_ipc.py), "
                            "not moved by cross-memory attach")
        return CmaRowsMover(engine_pid)
    if device.startswith("cuda"):
        if kind == "memmove":
            raise MoveError("the memmove mover moves host memory only; a CUDA device's is moved by the cuda mover")
        index = int(device.partition(":")[2] or 0)
        if kind == "cuda_mapped":
            from kvproc.workers.mapped_mover import MappedMover  # lazy: a CPU process never imports the CUDA path

            return MappedMover(index)
        from kvproc.workers.cuda_mover import CudaMover

        return CudaMover(index)
    if device != "cpu":
        raise MoveError(f"no mover for device {device!r}")
    if kind in CUDA_MOVERS:
        raise MoveError(f"the {kind} mover moves between a CUDA device and pinned host memory; device {device!r} "
                        "is not a CUDA device")
    if kind == "torch":
        from kvproc.workers.torch_mover import TORCH  # lazy: it imports this module (MoveError)

        return TORCH
    return MEMMOVE
