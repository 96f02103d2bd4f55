"""`RankedModel`: a tiny model run by N ranks in lock step (tensor parallel, as the reference engine drives it).

Each rank is a replica of the same seeded model with its own arenas (its own allocation, its own device pool in the
store): `arenas(rank)` is rank `rank`'s shard. A real tensor-parallel model splits heads across ranks and all-reduces;
the tiny models instead compute the whole forward on every rank over that rank's own KV, which keeps every kvproc
call the engine makes exactly what a sharded engine makes (one resolve/seal/retire per rank, on that rank's pool and
tier) while letting the engine check the ranks against each other: a rank whose restored KV is wrong produces other
logits than rank 0 (`Engine` raises on it), which a sharded forward would hide inside its all-reduce.
"""

from __future__ import annotations

from typing import Any

import torch

from kvproc.contract import ArenaId, KvArena, KvSpec, RepackDirection
from kvproc.engine.models import Allocator, TinyModel, build_model, default_allocator


class RankedModel:
    """N replicas of `build_model(name, **kwargs)`, one per rank; a `kvproc.RankedEngineModel` (the engine's protocol
    for N ranks, which a user's own TP model implements the same way)."""

    def __init__(self, name: str, ranks: int, *, allocator: Allocator = default_allocator, **kwargs: Any) -> None:
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        # the default allocator is passed on as itself: a model on a GPU then allocates its arenas there
        self.replicas: list[TinyModel] = [
            build_model(name, allocator=allocator if allocator is default_allocator else
                        lambda arena, nbytes, r=r: allocator(f"r{r}.{arena}", nbytes), **kwargs)
            for r in range(ranks)]
        lead = self.replicas[0]
        self.name, self.vocab_size, self.eos_token_id = lead.name, lead.vocab_size, lead.eos_token_id
        self.num_blocks, self.num_slots, self.page_tokens = lead.num_blocks, lead.num_slots, lead.page_tokens

    @property
    def ranks(self) -> int:
        return len(self.replicas)

    def spec(self) -> KvSpec:
        return self.replicas[0].spec()  # one seed: every replica has the same weights, so the same model_id

    def rank_model(self, rank: int) -> TinyModel:
        """Rank `rank`'s replica: what the engine steps on that rank (`kvproc.RankedEngineModel`)."""
        return self.replicas[rank]

    def arenas(self, rank: int) -> list[tuple[str, KvArena]]:
        if not 0 <= rank < len(self.replicas):
            raise ValueError(f"{self.name}: rank {rank} is outside this model's ranks [0, {len(self.replicas)})")
        return self.replicas[rank].arenas(0)

    def repack(self, group: str, direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor,
               arena: ArenaId) -> None:
        self.replicas[0].repack(group, direction, src, dst, arena)


def rank_models(model: TinyModel | RankedModel) -> list[TinyModel]:
    """The model each rank computes with: a `RankedModel`'s replicas, or a one-rank model itself."""
    return list(model.replicas) if isinstance(model, RankedModel) else [model]
