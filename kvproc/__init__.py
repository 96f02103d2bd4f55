"""kvproc: a KV-cache store for LLM serving engines."""

from kvproc.contract import (
    ArenaLayout,
    GroupKind,
    GroupSpec,
    KvArena,
    KvContractError,
    KvModel,
    KvSpec,
    RepackDirection,
    Sharding,
    validate_layout,
)

__all__ = [
    "ArenaLayout",
    "GroupKind",
    "GroupSpec",
    "KvArena",
    "KvContractError",
    "KvModel",
    "KvSpec",
    "RepackDirection",
    "Sharding",
    "validate_layout",
]
