"""What the reference engine needs from a model, beyond the KV contract: one typed protocol per topology.

The KV contract (`kvproc.KvModel`: spec, arenas, repack) is all kvproc itself needs. The reference engine
(`kvproc/engine/engine.py`) also runs the model, so it needs a forward pass, the vocabulary's size, the EOS id and a
way to reset a bounded group's live slot (zeros are every model's initial state). That is `EngineModel` for one rank.

For N ranks (`Engine(model, store, ranks=N)`) a model is a `RankedEngineModel`: the contract for every rank
(`arenas(r)` is rank r's shard) and `rank_model(r)`, the `RankStep` that computes rank r's step over rank r's arenas.
The engine runs every rank on the same tokens and samples rank 0's logits; another rank's logits that differ beyond
float rounding mean its KV differs (a wrong restore) and stop the engine. A user's own TP model implements these
members; nothing else of kvproc changes (`RankedModel` is the built-in tiny models' implementation).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from kvproc.contract import KvModel

if TYPE_CHECKING:
    import torch

    from kvproc.engine.models.base import SeqBatchItem


@runtime_checkable
class RankStep(Protocol):
    """One rank's computation: what the engine calls on every step and at admission."""

    def forward(self, batch: Sequence["SeqBatchItem"]) -> "torch.Tensor":
        """float32 logits [len(batch), vocab] at the last new position of each item. Each item's new tokens' KV is
        written into its blocks (`block_ids[p // page_tokens]` holds position p) and live slots (`slots[group]`), and
        every earlier position is read back from them: never from a cache of the model's own (kvproc restores a
        prefix by copying bytes into the arenas)."""
        ...

    def reset_slot(self, group: str, slot: int) -> None:
        """Set live slot `slot` of bounded group `group` to the model's initial state (before a restore or a first
        step)."""
        ...


@runtime_checkable
class EngineModel(KvModel, RankStep, Protocol):
    """A one-rank model the reference engine serves: the KV contract, one rank's step, and its vocabulary."""

    name: str  # a label (logs, the fingerprint's `model=`); the weights' identity is `spec().model_id`
    vocab_size: int
    eos_token_id: int


@runtime_checkable
class RankedEngineModel(KvModel, Protocol):
    """A model of `ranks` ranks in lock step (`Engine(model, store, ranks=N)`): `arenas(r)` is rank r's shard and
    `rank_model(r)` computes rank r's step over it."""

    name: str
    vocab_size: int
    eos_token_id: int

    @property
    def ranks(self) -> int: ...

    def rank_model(self, rank: int) -> RankStep: ...


_ENGINE_MEMBERS = ("spec", "arenas", "repack", "name", "vocab_size", "eos_token_id")


def rank_steps(model: object, ranks: int) -> list[RankStep]:
    """The step of each of `ranks` ranks, or a `TypeError` naming what the model lacks (checked before any store
    call, so an integrator reads the missing member, not an AttributeError from inside a step)."""
    missing = [m for m in _ENGINE_MEMBERS if not hasattr(model, m)]
    ranked = hasattr(model, "rank_model") and hasattr(model, "ranks")
    if not ranked:
        missing += [m for m in ("forward", "reset_slot") if not hasattr(model, m)]
    if missing:
        raise TypeError(f"{type(model).__name__} is not a model the reference engine can run: it lacks {missing} "
                        "(kvproc.EngineModel for one rank, kvproc.RankedEngineModel for several)")
    if not ranked:
        if ranks != 1:
            raise ValueError(f"ranks={ranks} needs a RankedEngineModel (ranks, rank_model(r)); "
                             f"{type(model).__name__} is a one-rank EngineModel")
        return [model]  # type: ignore[list-item]  # checked above: forward and reset_slot
    have = int(model.ranks)  # type: ignore[attr-defined]
    if have != ranks:
        raise ValueError(f"ranks={ranks}, but {type(model).__name__} has {have} rank(s)")
    return [model.rank_model(r) for r in range(ranks)]  # type: ignore[attr-defined]
