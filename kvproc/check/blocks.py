"""Bytes of a layout's blocks and slots: fill them with random bytes, copy them out, find where two copies differ.

One vectorised gather per arena (`torch` index of every wanted byte), never a Python loop over bytes."""

from __future__ import annotations

import torch

from kvproc.check.report import Failure
from kvproc.contract import ArenaLayout, KvArena

# arena name -> [n, bytes_per_block] copy of the blocks (or slots) asked for, in the order asked
Snapshot = dict[str, torch.Tensor]


def _rows(arena: KvArena, ids: list[int]) -> torch.Tensor:
    """Flat byte indices of blocks `ids` of `arena`, shaped [len(ids), bytes_per_block]."""
    base = torch.tensor(ids, dtype=torch.long).unsqueeze(1) * arena.block_stride
    return base + torch.arange(arena.bytes_per_block, dtype=torch.long).unsqueeze(0)


def _arenas(layout: ArenaLayout, groups: list[str]) -> list[tuple[str, KvArena]]:
    return [(g, a) for g, a in layout.arenas if g in groups]


def fill(layout: ArenaLayout, groups: list[str], ids: list[int], gen: torch.Generator) -> None:
    """Random bytes into blocks (or slots) `ids` of every arena of `groups`."""
    for _, a in _arenas(layout, groups):
        if ids:
            idx = _rows(a, ids).to(a.tensor.device)
            a.byte_view()[idx] = torch.randint(0, 256, idx.shape, dtype=torch.uint8, generator=gen).to(idx.device)


def scramble(layout: ArenaLayout, gen: torch.Generator) -> None:
    """Random bytes over every arena whole: a restore that does not happen is then seen."""
    for _, a in layout.arenas:
        bv = a.byte_view()
        bv.copy_(torch.randint(0, 256, bv.shape, dtype=torch.uint8, generator=gen).to(bv.device))


def snapshot(layout: ArenaLayout, groups: list[str], ids: list[int]) -> Snapshot:
    return {a.name: a.byte_view()[_rows(a, ids).to(a.tensor.device)].cpu() for _, a in _arenas(layout, groups)}


def compare(check: str, layout: ArenaLayout, groups: list[str], ids: list[int], want: Snapshot,
            by_position: bool = False, expected_as: str = "was saved") -> list[Failure]:
    """A failure per arena of `groups` whose blocks `ids` differ from `want`, at the first differing byte (its offset
    in the arena). `by_position`: `want` is another layout's (another rank, another engine): its arenas are matched
    by their position within the group, not by name."""
    out = []
    theirs = list(want.values())
    mine = _arenas(layout, groups)
    for i, (g, a) in enumerate(mine):
        expected = theirs[i] if by_position else want[a.name]
        got = a.byte_view()[_rows(a, ids).to(a.tensor.device)].cpu()
        if got.shape != expected.shape:
            out.append(Failure(check, g, f"{tuple(got.shape)} bytes where {tuple(expected.shape)} were saved",
                               a.name))
            continue
        diff = (got != expected).nonzero()
        if len(diff):
            row, col = int(diff[0, 0]), int(diff[0, 1])
            offset = ids[row] * a.block_stride + col
            n = int((got != expected).sum())
            out.append(Failure(check, g, f"block {ids[row]} byte {col}: {int(got[row, col])} where "
                               f"{int(expected[row, col])} {expected_as} ({n} bytes differ)", a.name, offset))
    return out
