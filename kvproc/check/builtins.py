"""Factories of the built-in tiny models for `kvproc check MODULE:FACTORY` (e.g. `kvproc check
kvproc.check.builtins:mla`): what the command runs on, and an example of what a factory is (no arguments, returns a
fresh model the check may write into)."""

from __future__ import annotations

import dataclasses

from kvproc.contract import KvSpec, Sharding
from kvproc.engine.models import TinyModel, build_model
from kvproc.engine.models.ranked import RankedModel

BLOCKS, SLOTS = 16, 4  # enough for every proof's pages and checkpoints, small enough to check in a second


def dense() -> TinyModel:
    return build_model("dense", num_blocks=BLOCKS, num_slots=SLOTS)


def mla() -> TinyModel:
    return build_model("mla", num_blocks=BLOCKS, num_slots=SLOTS)


def mla_mtp_drafter() -> TinyModel:
    """MLA with an optional MTP layer and a drafter (not checkpointable): prefix caching off, the table says why."""
    return build_model("mla", mtp=True, drafter=True, num_blocks=BLOCKS, num_slots=SLOTS)


def hybrid() -> TinyModel:
    return build_model("hybrid", num_blocks=BLOCKS, num_slots=SLOTS)


def swa() -> TinyModel:
    return build_model("swa", num_blocks=BLOCKS, num_slots=SLOTS)


def dense_tp2() -> RankedModel:
    return RankedModel("dense", 2, num_blocks=BLOCKS, num_slots=SLOTS)


class ReplicatedMla(RankedModel):
    """MLA under tensor parallel: every rank holds the same latent cache, so every group is REPLICATED (stored once,
    restored on every rank)."""

    def spec(self) -> KvSpec:
        spec = super().spec()
        return dataclasses.replace(spec, groups=tuple(dataclasses.replace(g, sharding=Sharding.REPLICATED)
                                                      for g in spec.groups))


def mla_tp2_replicated() -> ReplicatedMla:
    return ReplicatedMla("mla", 2, num_blocks=BLOCKS, num_slots=SLOTS)
