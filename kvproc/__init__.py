"""kvproc: a KV-cache store for LLM serving engines.

Public names are resolved lazily (PEP 562) so that `import kvproc.ipc...` in a process that only routes metadata
(the host tier, the console) does not import torch or the pool.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    # the contract
    "ArenaLayout": "kvproc.contract",
    "GroupKind": "kvproc.contract",
    "GroupSpec": "kvproc.contract",
    "KvArena": "kvproc.contract",
    "KvContractError": "kvproc.contract",
    "KvModel": "kvproc.contract",
    "KvSpec": "kvproc.contract",
    "RepackDirection": "kvproc.contract",
    "Sharding": "kvproc.contract",
    "validate_layout": "kvproc.contract",
    # hashing
    "BlockHasher": "kvproc.hashing",
    "DEFAULT_SCOPE": "kvproc.hashing",
    "HashAlgorithm": "kvproc.hashing",
    "HashScope": "kvproc.hashing",
    "PAD_TOKEN_ID": "kvproc.hashing",
    "PageHashes": "kvproc.hashing",
    # pool, holds, requests
    "BlockPool": "kvproc.pool",
    "CopyKind": "kvproc.bounded",
    "CopyOrder": "kvproc.bounded",
    "HoldConsumedError": "kvproc.holds",
    "MissReason": "kvproc.holds",
    "Pin": "kvproc.holds",
    "PrefixHold": "kvproc.holds",
    "Reservation": "kvproc.holds",
    "ReusePolicy": "kvproc.holds",
    "PoolExhaustedError": "kvproc.paged",
    "StaleBlockError": "kvproc.paged",
    "LifetimeExceededError": "kvproc.request_kv",
    "RequestKv": "kvproc.request_kv",
    "RequestStateError": "kvproc.request_kv",
    # the store and its verbs
    "KvStore": "kvproc.store",
    "InvalidSealCursor": "kvproc.store_types",
    "KvPrefix": "kvproc.store_types",
    "ResolvePolicy": "kvproc.store_types",
    "SaveClass": "kvproc.store_types",
    "SealCursor": "kvproc.store_types",
    "StoreConfig": "kvproc.store_types",
    "build_local_store": "kvproc.build",
    "ClusterStore": "kvproc.cluster",
    # processes
    "launch": "kvproc.runtime",
    "CancelToken": "kvproc.ipc.cancel",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'kvproc' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:
    from kvproc.bounded import CopyKind, CopyOrder
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
    from kvproc.hashing import DEFAULT_SCOPE, PAD_TOKEN_ID, BlockHasher, HashAlgorithm, HashScope, PageHashes
    from kvproc.holds import HoldConsumedError, MissReason, Pin, PrefixHold, Reservation, ReusePolicy
    from kvproc.paged import PoolExhaustedError, StaleBlockError
    from kvproc.pool import BlockPool
    from kvproc.request_kv import LifetimeExceededError, RequestKv, RequestStateError
    from kvproc.build import build_local_store
    from kvproc.cluster import ClusterStore
    from kvproc.ipc.cancel import CancelToken
    from kvproc.runtime import launch
    from kvproc.store import KvStore
    from kvproc.store_types import InvalidSealCursor, KvPrefix, ResolvePolicy, SaveClass, SealCursor, StoreConfig
