"""Models broken on purpose, one per failure kind `kvproc check` must name (factories for `kvproc check
tests.check.broken_models:NAME`). Each is a built-in tiny model with one thing wrong."""

from __future__ import annotations

import dataclasses

import torch

from kvproc import ArenaId, KvArena, KvSpec, RepackDirection, Sharding
from kvproc.engine.models import build_model
from kvproc.engine.models.dense import DenseModel
from kvproc.engine.models.mla import MlaModel
from kvproc.engine.models.ranked import RankedModel

BLOCKS, SLOTS = 16, 4
BAD_BYTE = 100  # the byte of every latent row the wrong repack gets wrong


class WrongRepackMla(MlaModel):
    """The MLA wire layout, but LOAD gets one byte of each row wrong: not the inverse of SAVE."""

    def repack(self, group: str, direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor,
               arena: ArenaId) -> None:
        super().repack(group, direction, src, dst, arena)
        if RepackDirection(direction) is RepackDirection.LOAD and group == "latent":
            dst[:, BAD_BYTE] ^= 0x01


class UndeclaredLayoutDense(DenseModel):
    """Its repack stores K transposed (here: bytes reversed in each row), but no arena declares a stored_layout: kvproc
    never calls the hook and stores the executed bytes, while the author believes the layout applied."""

    def repack(self, group: str, direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor,
               arena: ArenaId) -> None:
        dst.copy_(src.flip(1))


class NotAppliedLayoutDense(DenseModel):
    """Declares a stored layout on every arena, but its repack copies the bytes unchanged (the layout is a no-op)."""

    def arenas(self, rank: int) -> list[tuple[str, KvArena]]:
        return [(g, dataclasses.replace(a, stored_layout="k-transposed-v1")) for g, a in super().arenas(rank)]


class WrongShardingDense(RankedModel):
    """Declares REPLICATED, but its ranks hold different KV (each rank its own heads: here, other weights)."""

    def __init__(self) -> None:
        super().__init__("dense", 2, num_blocks=BLOCKS, num_slots=SLOTS)
        self.replicas[1] = build_model("dense", seed=7, num_blocks=BLOCKS, num_slots=SLOTS)

    def spec(self) -> KvSpec:
        spec = super().spec()
        return dataclasses.replace(spec, groups=tuple(dataclasses.replace(g, sharding=Sharding.REPLICATED)
                                                      for g in spec.groups))


def wrong_repack() -> WrongRepackMla:
    return WrongRepackMla(num_blocks=BLOCKS, num_slots=SLOTS)


def undeclared_layout() -> UndeclaredLayoutDense:
    return UndeclaredLayoutDense(num_blocks=BLOCKS, num_slots=SLOTS)


def not_applied_layout() -> NotAppliedLayoutDense:
    return NotAppliedLayoutDense(num_blocks=BLOCKS, num_slots=SLOTS)


def wrong_sharding() -> WrongShardingDense:
    return WrongShardingDense()
