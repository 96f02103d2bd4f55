"""Module-level repack hooks, importable by name in a copy-worker process (`ClusterStore.attach_model(repack=...)`).

A worker cannot call a model instance's bound `repack`; it imports a `(group, direction, src, dst, arena)` function.
"""

from __future__ import annotations

import torch

from kvproc.contract import ArenaId, RepackDirection
from kvproc.engine.models import wire

LATENT_GROUP = "latent"


def mla_repack(group: str, direction: RepackDirection | str, src: torch.Tensor, dst: torch.Tensor,
               arena: ArenaId) -> None:
    """The MLA model's repack: the latent group has a wire layout, every other group is stored byte for byte."""
    if group == LATENT_GROUP:
        wire.repack_latent(RepackDirection(direction), src, dst)
    else:
        dst.copy_(src)


# model name -> "module:function" for models whose stored layout differs from the execution layout
REPACK_PATHS = {"mla": "kvproc.engine.repack:mla_repack"}
