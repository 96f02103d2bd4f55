"""What the model tests share: tiny models of each shape, token draws, and running a chunked forward."""

from __future__ import annotations

import itertools

import torch

from kvproc.engine.models import (
    SeqBatchItem,
    TinyModel,
    build_model,
)

PT = 16
NUM_BLOCKS = 48
NUM_SLOTS = 6


def make(name: str, seed: int = 0, **kw: object) -> TinyModel:
    return build_model(name, num_blocks=NUM_BLOCKS, num_slots=NUM_SLOTS, page_tokens=PT, seed=seed, **kw)


def tokens(model: TinyModel, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, model.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def slots(model: TinyModel, slot: int) -> dict[str, int]:
    return {g.name: slot for g in model.spec().bounded_groups}


def fresh(model: TinyModel, slot: int) -> dict[str, int]:
    s = slots(model, slot)
    for g in s:
        model.reset_slot(g, slot)
    return s


def run(model: TinyModel, toks: torch.Tensor, cuts: list[int], blocks: list[int], sl: dict[str, int]) -> torch.Tensor:
    """Feed toks[cuts[i]:cuts[i+1]] as successive chunks; logits of the last chunk."""
    out = torch.empty(0)
    for a, b in itertools.pairwise(cuts):
        out = model.forward([SeqBatchItem(toks[a:b], a, blocks, sl)])[0]
    return out


def copy_state(model: TinyModel, src_blocks: list[int], dst_blocks: list[int], live: int, staging: int,
               new_live: int) -> None:
    """What kvproc does: page bytes block -> block; bounded bytes live -> staging (seal) -> a new live slot."""
    bounded = {g.name for g in model.spec().bounded_groups}
    for group, arena in model.arenas(0):
        raw = arena.byte_view().view(arena.num_blocks, arena.block_stride)
        if group in bounded:
            raw[staging] = raw[live]
            raw[new_live] = raw[staging]
        else:
            raw[torch.tensor(dst_blocks)] = raw[torch.tensor(src_blocks)]
