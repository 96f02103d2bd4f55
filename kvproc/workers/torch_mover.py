"""The torch rows mover: rows between flat uint8 torch tensors on any device, a whole batch in three calls.

This is the GPU path's batch logic with nothing CUDA-specific in it, so that it runs, and is tested, on CPU tensors
too (`mover_for("cpu", kind="torch")`): the ids are checked on the host first (one min/max per side, before any byte
moves), then one gather (`index_select` into a contiguous staging tensor), one bulk copy to the destination's device
(nothing on one device) and one scatter (`index_copy_`). There is no Python call per block. The gather finishes
before the scatter starts, so a batch whose source and destination rows overlap (a device copy within one arena)
moves the rows as they were before the batch.

`CudaMover` (`kvproc/workers/cuda_mover.py`) is this mover plus its own save/load streams, pinned staging and an
event; it overrides `_move` only, so every check here is the one the GPU path runs.

A destination row named twice in one batch: which write wins is unspecified (the CPU movers keep the last one).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from kvproc.workers.movers import MoveError


def ids_tensor(ids: Sequence[int] | np.ndarray | torch.Tensor) -> torch.Tensor:
    """A batch's ids as one int64 CPU tensor (zero-copy for an int64 numpy array or tensor)."""
    if isinstance(ids, torch.Tensor):
        return ids.to(device="cpu", dtype=torch.int64)
    if isinstance(ids, np.ndarray):
        return torch.from_numpy(ids.astype(np.int64, copy=False))
    return torch.tensor(ids, dtype=torch.int64)


def rows_view(flat: torch.Tensor, stride: int, row: int) -> torch.Tensor:
    """(rows, row bytes) strided view of a flat uint8 tensor whose rows start `stride` bytes apart (no copy)."""
    n = (flat.numel() - row) // stride + 1 if flat.numel() >= row else 0
    return torch.as_strided(flat, (n, row), (stride, 1))


class TorchRowsMover:
    """Flat uint8 torch tensors (either side on any device, CPU included) to flat uint8 torch tensors."""

    name = "torch"
    host_views = False  # its buffers are torch tensors, maybe on a GPU: the executor keeps them as tensors

    def rows(self, dst: torch.Tensor, dst_stride: int, dst_ids: Sequence[int] | np.ndarray | torch.Tensor,
             src: torch.Tensor, src_stride: int, src_ids: Sequence[int] | np.ndarray | torch.Tensor, row: int,
             gil_bytes: int) -> int:
        del gil_bytes  # torch releases the GIL in its own kernels
        di, si = ids_tensor(dst_ids), ids_tensor(src_ids)
        n = int(di.numel())
        if n != si.numel():
            raise MoveError(f"{n} destination rows against {si.numel()} source rows")
        if n == 0:
            return 0
        d, s = rows_view(dst, dst_stride, row), rows_view(src, src_stride, row)
        # on the host, before any byte moves: a bad id refuses the whole batch
        if int(di.min()) < 0 or int(di.max()) >= d.shape[0] or int(si.min()) < 0 or int(si.max()) >= s.shape[0]:
            raise MoveError(f"ids out of range (destination < {d.shape[0]}, source < {s.shape[0]})")
        try:
            self._move(d, di, s, si, n, row)
        except RuntimeError as e:  # a device error (out of memory, a lost device): the batch failed
            raise MoveError(f"{self.name} move of {n} rows failed: {e}") from None
        return n * row

    def _move(self, d: torch.Tensor, di: torch.Tensor, s: torch.Tensor, si: torch.Tensor, n: int, row: int) -> Any:
        """Gather, bulk copy, scatter; ids already checked. On CPU the bulk copy is a no-op."""
        staged = s.index_select(0, si.to(s.device))
        d.index_copy_(0, di.to(d.device), staged.to(d.device))


TORCH = TorchRowsMover()
