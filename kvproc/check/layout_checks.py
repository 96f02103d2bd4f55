"""The proofs about stored layouts, on the model's `repack` alone (no store): a declared layout is really applied
(the stored bytes differ from the executed ones) and LOAD after SAVE is the identity, row by row; an arena that
declares no layout is not secretly converted by the hook (kvproc never calls it there)."""

from __future__ import annotations

import torch

from kvproc.check.report import CheckReport, Failure
from kvproc.contract import ArenaLayout, KvArena, KvModel, RepackDirection

ROWS = 4  # blocks repacked together (the copy worker hands the hook several at once)


def _first_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int] | None:
    d = (a != b).nonzero()
    return (int(d[0, 0]), int(d[0, 1])) if len(d) else None


def _declared(model: KvModel, layout: ArenaLayout, group: str, a: KvArena, gen: torch.Generator) -> list[Failure]:
    ident = layout.arena_id(a.name)
    src = torch.randint(0, 256, (ROWS, a.bytes_per_block), dtype=torch.uint8, generator=gen)
    stored = torch.zeros((ROWS, a.stored_bytes), dtype=torch.uint8)
    back = torch.zeros((ROWS, a.bytes_per_block), dtype=torch.uint8)
    check = "stored layout"
    try:
        model.repack(group, RepackDirection.SAVE, src.clone(), stored, ident)
    except Exception as e:  # noqa: BLE001 - reported, with the arena
        return [Failure(check, group, f"repack(SAVE) raised {e!r}", a.name)]
    if a.stored_bytes == a.bytes_per_block and torch.equal(stored, src):
        return [Failure(check, group, f"declares stored_layout={a.stored_layout!r}, but repack(SAVE) stores the "
                        "executed bytes unchanged: the layout is not applied", a.name)]
    try:
        model.repack(group, RepackDirection.LOAD, stored.clone(), back, ident)
    except Exception as e:  # noqa: BLE001
        return [Failure(check, group, f"repack(LOAD) of what repack(SAVE) stored raised {e!r}", a.name)]
    at = _first_diff(back, src)
    if at is not None:
        return [Failure(check, group, f"LOAD after SAVE is not the identity: row {at[0]}, byte {at[1]} of the block "
                        f"is {int(back[at])}, was {int(src[at])} ({int((back != src).sum())} bytes differ)",
                        a.name, at[1])]
    one = torch.zeros((1, a.stored_bytes), dtype=torch.uint8)  # each row on its own: batches are any blocks
    model.repack(group, RepackDirection.SAVE, src[2:3].clone(), one, ident)
    at = _first_diff(one, stored[2:3])
    if at is not None:
        return [Failure(check, group, f"a row's stored bytes depend on the other rows of its batch (row 2 alone "
                        f"differs at byte {at[1]}): repack each row on its own", a.name, at[1])]
    return []


def _undeclared(model: KvModel, layout: ArenaLayout, group: str, a: KvArena, gen: torch.Generator) -> list[Failure]:
    src = torch.randint(0, 256, (ROWS, a.bytes_per_block), dtype=torch.uint8, generator=gen)
    out = torch.zeros_like(src)
    try:
        model.repack(group, RepackDirection.SAVE, src.clone(), out, layout.arena_id(a.name))
    except Exception:  # noqa: BLE001 - a hook that only knows its declared arenas: never called here, fine
        return []
    at = _first_diff(out, src)
    if at is None:
        return []
    return [Failure("undeclared layout", group, f"repack(SAVE) changes this arena's bytes (first at byte {at[1]} of "
                    "a block) but the arena declares no stored_layout, so kvproc never calls repack for it and "
                    "stores the executed bytes: declare KvArena(..., stored_layout='my-layout-v1')", a.name, at[1])]


def stored_layouts(model: KvModel, layout: ArenaLayout, report: CheckReport, gen: torch.Generator) -> None:
    failures: list[Failure] = []
    declared = []
    for group, a in layout.arenas:
        if a.repacked:
            declared.append(f"{a.name}={a.stored_layout}")
            failures += _declared(model, layout, group, a, gen)
        else:
            failures += _undeclared(model, layout, group, a, gen)
    report.failures += failures
    if failures:
        return
    if declared:
        report.passed.append(f"stored layouts applied (stored bytes differ), LOAD after SAVE the identity, row by "
                             f"row: {', '.join(declared)}")
    else:
        report.passed.append("no stored layout declared, and repack converts no arena: stored as executed")
