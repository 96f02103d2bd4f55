"""Tiny seeded torch models whose KV lives in kvproc arenas (dense, mla, hybrid, swa)."""

from __future__ import annotations

from typing import Any

from kvproc.engine.models.base import (
    PAD_TOKEN_ID,
    Allocator,
    SeqBatchItem,
    TinyModel,
    default_allocator,
)

MODEL_NAMES = ("dense", "mla", "hybrid", "swa")


def build_model(name: str, **kwargs: Any) -> TinyModel:
    """Build a model by name; kwargs go to its constructor (num_blocks, num_slots, page_tokens, seed, allocator,
    and shape options)."""
    if name == "dense":
        from kvproc.engine.models.dense import DenseModel

        return DenseModel(**kwargs)
    if name == "mla":
        from kvproc.engine.models.mla import MlaModel

        return MlaModel(**kwargs)
    if name == "hybrid":
        from kvproc.engine.models.hybrid import HybridModel

        return HybridModel(**kwargs)
    if name == "swa":
        from kvproc.engine.models.swa import SwaModel

        return SwaModel(**kwargs)
    raise ValueError(f"unknown model {name!r}; choose one of {MODEL_NAMES}")


__all__ = ["MODEL_NAMES", "PAD_TOKEN_ID", "Allocator", "SeqBatchItem", "TinyModel", "build_model",
           "default_allocator"]
