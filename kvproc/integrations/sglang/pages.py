"""One SGLang host pool's page, as bytes: where its parts lie in the pool and how they are stored in kvproc's tier.

SGLang's zero-copy path names a page by its host indices; the pool's `get_page_buffer_meta` turns them into the
(pointer, size) parts a backend copies: two per page for MHA in the page-first layouts (K, then V, each every layer
of the page), one per layer and component in `layer_first`, one or one per layer for MLA. The tier stores a page as
one row: its parts in that order, back to back (`PageFormat.part_bytes`). The non-zero-copy path (`batch_get` /
`batch_set`) moves the pool's flat data page instead (`get_data_page(flat=True)`), whose byte order differs from
the parts' in MHA's `layer_first`; the two are stored under different format names, so a tier never hands one's
bytes to the other (`PageFormat.arena_name`).

Pages are read from the pool's own buffer through a numpy view (offset = pointer - buffer start, bounds checked
against the buffer): no raw pointer is dereferenced, and a bad index fails as an error, never as a stray copy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvproc.integrations.sglang.errors import SglangConfigError, SglangInputError


@dataclass(frozen=True)
class PageFormat:
    pool: str  # "mha", "mla", ...: the host pool's kind
    layout: str  # SGLang's host layout: layer_first, page_first, page_first_direct, ...
    dtype: str
    page_tokens: int
    part_bytes: tuple[int, ...]  # one page's zero-copy parts, in get_page_buffer_meta's order
    flat_bytes: int  # one page as the pool's flat data page (the non-zero-copy path)

    @property
    def page_bytes(self) -> int:
        return sum(self.part_bytes)

    def arena_name(self, zero_copy: bool) -> str:
        """The tier arena's name: part of the tier's fingerprint, so two backends whose pages differ in kind,
        layout, dtype or byte order never share a tier (sizes are in the fingerprint too)."""
        order = "parts" if zero_copy else "flat"
        return f"sglang.{self.pool}.{self.layout}.{self.dtype}.{order}"


def _pool_kind(pool: Any) -> str:
    name = type(pool).__name__
    for kind in ("MHA", "MLA"):
        if name.startswith(kind):
            return kind.lower()
    return name.lower()


class HostPoolPages:
    """The registered host pool's pages: its format and copies between its pages and rows of bytes."""

    def __init__(self, pool: Any) -> None:
        buf = getattr(pool, "kv_buffer", None)
        if not isinstance(buf, torch.Tensor):
            raise SglangConfigError(f"kvproc backend: host pool {type(pool).__name__} has no kv_buffer tensor (a "
                                    "hybrid model's pools go through SGLang's *_v2 interface, not served yet)")
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise SglangConfigError(f"kvproc backend: host pool {type(pool).__name__}'s kv_buffer must be one "
                                    f"contiguous host tensor, got {buf.device} contiguous={buf.is_contiguous()}")
        self.pool = pool
        self.page_tokens = int(pool.page_size)
        self.size = int(pool.size)  # tokens the pool holds
        self._base = buf.data_ptr()
        self._flat = buf.reshape(-1).view(torch.uint8).numpy()  # shares the pool's memory
        _, sizes = pool.get_page_buffer_meta(torch.arange(self.page_tokens, dtype=torch.int64))
        dummy = pool.get_dummy_flat_data_page()
        self.format = PageFormat(_pool_kind(pool), str(pool.layout), str(pool.dtype).removeprefix("torch."),
                                 self.page_tokens, tuple(int(s) for s in sizes),
                                 dummy.numel() * dummy.element_size())
        if self.format.flat_bytes != self.format.page_bytes:
            raise SglangConfigError(f"kvproc backend: {type(pool).__name__} pages are {self.format.page_bytes} bytes "
                                    f"by their parts but {self.format.flat_bytes} as a flat page")

    def offsets(self, host_indices: Any, pages: int) -> np.ndarray:
        """[pages, parts] byte offsets into the pool's buffer of the pages `host_indices` names (page_tokens
        consecutive, page-aligned indices per page, as SGLang's host allocator hands them out)."""
        if not isinstance(host_indices, torch.Tensor) or host_indices.dim() != 1 or host_indices.is_floating_point():
            raise SglangInputError(f"host_indices must be a 1-D integer tensor, got "
                                   f"{type(host_indices).__name__} {getattr(host_indices, 'shape', '')}")
        pt = self.page_tokens
        if host_indices.numel() != pages * pt:
            raise SglangInputError(f"{pages} keys need {pages * pt} host indices ({pt} a page), got "
                                   f"{host_indices.numel()}")
        if pages == 0:
            return np.zeros((0, len(self.format.part_bytes)), dtype=np.int64)
        idx = host_indices.to(torch.int64).view(pages, pt)
        first = idx[:, 0]
        if bool((first % pt != 0).any()) or bool((idx != first[:, None] + torch.arange(pt)).any()):
            raise SglangInputError("host_indices must be whole pages: each key's indices consecutive from a "
                                   f"multiple of the page size ({pt})")
        if int(first.min()) < 0 or int(first.max()) + pt > self.size:
            raise SglangInputError(f"host_indices out of the host pool's {self.size} tokens")
        ptrs, sizes = self.pool.get_page_buffer_meta(host_indices)
        parts = len(self.format.part_bytes)
        if len(ptrs) != pages * parts or tuple(sizes[:parts]) != self.format.part_bytes:
            raise SglangInputError(f"the host pool described {len(ptrs)} parts for {pages} pages; its format "
                                   f"has {parts} a page")
        off = np.asarray(ptrs, dtype=np.int64).reshape(pages, parts) - self._base
        end = off + np.asarray(self.format.part_bytes, dtype=np.int64)
        if int(off.min()) < 0 or int(end.max()) > self._flat.size:  # the pool's own bug; never copy outside it
            raise SglangInputError("the host pool's page parts lie outside its kv_buffer")
        return off

    def read(self, off: np.ndarray, row: np.ndarray) -> None:
        """One page (its row of `offsets`) from the pool into `row` (the tier's slot)."""
        pos = 0
        for o, n in zip(off.tolist(), self.format.part_bytes):
            row[pos:pos + n] = self._flat[o:o + n]
            pos += n

    def write(self, row: np.ndarray, off: np.ndarray) -> None:
        """`row` (the tier's slot) into one page of the pool."""
        pos = 0
        for o, n in zip(off.tolist(), self.format.part_bytes):
            self._flat[o:o + n] = row[pos:pos + n]
            pos += n
