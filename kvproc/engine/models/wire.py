"""The MLA latent wire layout: what a latent row looks like in a tier, and the exact conversion to and from it.

Execution row: 144 float32 = 576 bytes. Wire row: 656 bytes = the same 576 payload bytes, then 80 bytes of
metadata: 16 float32 per-tile absolute maxima (tiles of 9 floats; the scales a quantising tier would keep), a
uint32 magic, a uint32 checksum of the payload words, and 8 reserved zero bytes. Keeping the payload verbatim makes
SAVE -> LOAD bit-exact; LOAD checks magic and checksum so a corrupted or misplaced stored row fails loudly instead of
becoming wrong attention.

The format is defined per row, so a block of one arena (page_tokens rows) or several arenas' blocks laid end to end
convert identically: repack does not need to know which layer's arena a block came from.
"""

from __future__ import annotations

import torch

from kvproc.contract import RepackDirection

EXEC_ROW_FLOATS = 144
EXEC_ROW_BYTES = EXEC_ROW_FLOATS * 4  # 576
TILES = 16
META_BYTES = TILES * 4 + 4 + 4 + 8  # 80
WIRE_ROW_BYTES = EXEC_ROW_BYTES + META_BYTES  # 656
WIRE_LAYOUT = "mla-wire-v1"  # the stored layout's name (KvArena.stored_layout): bump it with any change of the rows
MAGIC = 0x4C574B56  # "VKWL" little-endian; any fixed non-zero word


def _checksum(payload: torch.Tensor) -> torch.Tensor:
    """Sum of the payload's int32 words mod 2**32, as int32 [n] (wrapping, so it is exact and order-free)."""
    s = payload.view(torch.int32).to(torch.int64).sum(-1) & 0xFFFFFFFF
    return torch.where(s >= 2**31, s - 2**32, s).to(torch.int32)


def _rows(t: torch.Tensor, row_bytes: int, what: str) -> torch.Tensor:
    if t.dtype != torch.uint8 or t.dim() != 2 or t.shape[1] % row_bytes:
        raise ValueError(f"mla repack: {what} must be uint8 [n_blocks, k*{row_bytes}], got {t.dtype}"
                         f" {tuple(t.shape)}")
    return t.contiguous().view(-1, row_bytes)


def repack_latent(direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor) -> None:
    """SAVE: execution rows (576 B) -> wire rows (656 B). LOAD: wire rows -> execution rows, verified."""
    save = direction is RepackDirection.SAVE
    s_row, d_row = (EXEC_ROW_BYTES, WIRE_ROW_BYTES) if save else (WIRE_ROW_BYTES, EXEC_ROW_BYTES)
    rows = _rows(src, s_row, "src")
    if dst.dtype != torch.uint8 or dst.dim() != 2 or dst.shape[0] != src.shape[0] or \
            dst.shape[1] != rows.shape[0] // src.shape[0] * d_row:
        raise ValueError(f"mla repack {direction.value}: dst must be uint8 [{src.shape[0]},"
                         f" {src.shape[1] // s_row * d_row}] for src {tuple(src.shape)}, got {dst.dtype}"
                         f" {tuple(dst.shape)}")
    n = rows.shape[0]
    if save:
        out = torch.empty(n, WIRE_ROW_BYTES, dtype=torch.uint8, device=rows.device)
        out[:, :EXEC_ROW_BYTES] = rows
        scales = rows.view(torch.float32).view(n, TILES, EXEC_ROW_FLOATS // TILES).abs().amax(-1)
        out[:, EXEC_ROW_BYTES : EXEC_ROW_BYTES + TILES * 4] = scales.contiguous().view(torch.uint8)
        meta = torch.zeros(n, 4, dtype=torch.int32, device=rows.device)
        meta[:, 0] = MAGIC
        meta[:, 1] = _checksum(rows)
        out[:, EXEC_ROW_BYTES + TILES * 4 :] = meta.view(torch.uint8)
    else:
        payload = rows[:, :EXEC_ROW_BYTES].contiguous()
        meta = rows[:, EXEC_ROW_BYTES + TILES * 4 :].contiguous().view(torch.int32)
        bad = (meta[:, 0] != MAGIC) | (meta[:, 1] != _checksum(payload))
        if bool(bad.any()):
            first = int(bad.nonzero()[0, 0])
            raise ValueError(f"mla repack load: {int(bad.sum())} of {n} wire rows fail the magic/checksum check"
                             f" (first: row {first}); the stored latent bytes are corrupt or not in the wire layout")
        out = payload
    dst.copy_(out.view(dst.shape))
