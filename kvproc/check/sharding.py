"""The sharding proof, from the model's own forward: every rank computes the same prompt, and a REPLICATED group's
KV must then be the same bytes on every rank (it is stored once and restored on all of them); a PER_RANK group whose
ranks all hold the same bytes is noted (REPLICATED would store it once instead of N times)."""

from __future__ import annotations

import torch

from kvproc.check.blocks import compare, snapshot
from kvproc.check.report import CheckReport, Failure
from kvproc.contract import ArenaLayout, GroupKind, Sharding
from kvproc.engine.models.base import SeqBatchItem

PAGES = 2


def ranks_compute(model: object, layouts: list[ArenaLayout], report: CheckReport, gen: torch.Generator) -> None:
    spec = layouts[0].spec
    if len(layouts) < 2:
        if any(g.sharding is Sharding.REPLICATED for g in spec.groups):
            report.notes.append("REPLICATED groups at 1 rank: stored once and restored on every rank is checked at "
                                "N ranks (a RankedEngineModel, or --ranks N)")
        return
    if not (hasattr(model, "rank_model") and hasattr(model, "vocab_size")):
        report.notes.append("sharding not checked against the model's KV: it has no rank_model(r).forward "
                            "(kvproc.RankedEngineModel); the sharding proofs ran on random bytes only")
        return
    n = PAGES * spec.page_tokens
    toks = torch.randint(0, int(model.vocab_size), (n,), generator=gen)
    bounded = [g.name for g in spec.bounded_groups]
    for r in range(len(layouts)):
        step = model.rank_model(r)
        for name in bounded:
            step.reset_slot(name, 0)
        step.forward([SeqBatchItem(toks, 0, list(range(PAGES)), {name: 0 for name in bounded})])
    same: list[str] = []
    for g in spec.groups:
        ids = list(range(PAGES)) if g.kind is GroupKind.PAGED else [0]
        base = snapshot(layouts[0], [g.name], ids)
        diffs = [f for r in range(1, len(layouts)) for f in
                 compare("sharding", layouts[r], [g.name], ids, base, by_position=True,
                         expected_as=f"on rank 0 (rank {r})")]
        if g.sharding is Sharding.REPLICATED and diffs:
            first = diffs[0]
            report.failures.append(Failure(
                "sharding", g.name, f"declared REPLICATED, but the ranks compute other KV for one prompt ("
                f"{first.detail}): it would be stored once from rank 0 and restored as rank 0's on every rank; "
                "declare Sharding.PER_RANK (each rank its own shard)", first.arena, first.offset))
        elif g.sharding is Sharding.PER_RANK and not diffs:
            same.append(g.name)
    if same:
        report.notes.append(f"groups {same} are PER_RANK but every rank computes the same bytes: REPLICATED would "
                            f"store them once instead of {len(layouts)} times")
    if not any(f.check == "sharding" for f in report.failures):
        report.passed.append(f"sharding: every rank's forward over one prompt agrees with its declaration "
                             f"({', '.join(f'{g.name}={g.sharding.value}' for g in spec.groups)})")
