"""kvproc: a KV-cache store for LLM serving engines.

Public names are resolved lazily (PEP 562) so that `import kvproc.ipc...` in a process that only routes metadata
(the host tier, the console) does not import torch or the pool.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS: dict[str, str] = {
    # the contract
    "ArenaId": "kvproc.contract",
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
    "BlockHasher": "kvproc.core.hashing",
    "DEFAULT_SCOPE": "kvproc.core.hashing",
    "DEFAULT_HASH": "kvproc.core.hashing",
    "HashAlgorithm": "kvproc.core.hashing",
    "HashScope": "kvproc.core.hashing",
    "PAD_TOKEN_ID": "kvproc.core.hashing",
    "PageHashes": "kvproc.core.hashing",
    # pool, holds, requests
    "BlockPool": "kvproc.core.pool",
    "CopyKind": "kvproc.core.bounded",
    "CopyOrder": "kvproc.core.bounded",
    "HoldConsumedError": "kvproc.core.holds",
    "ForeignHandleError": "kvproc.core.ownership",
    "MissReason": "kvproc.core.holds",
    "Pin": "kvproc.core.holds",
    "PrefixHold": "kvproc.core.holds",
    "Reservation": "kvproc.core.holds",
    "align_holds": "kvproc.core.holds",
    "ReusePolicy": "kvproc.core.holds",
    "PoolExhaustedError": "kvproc.core.paged",
    "StaleBlockError": "kvproc.core.paged",
    "LifetimeExceededError": "kvproc.core.request_kv",
    "RequestKv": "kvproc.core.request_kv",
    "RequestStateError": "kvproc.core.request_kv",
    # the store and its verbs
    "KvStore": "kvproc.store.kv_store",
    "InvalidSealCursor": "kvproc.store.types",
    "HandoffUnavailable": "kvproc.store.types",
    # P/D hand-off
    "HandoffEnvelope": "kvproc.store.handoff",
    "FingerprintMismatch": "kvproc.store.handoff",
    "fingerprint": "kvproc.store.handoff",
    "model_label": "kvproc.store.handoff",
    "check_fingerprint": "kvproc.store.handoff",
    "check_envelope": "kvproc.store.handoff",
    "chain_key": "kvproc.store.handoff",
    "padded_chain": "kvproc.store.handoff",
    "handoff_resolve_policy": "kvproc.store.handoff",
    "KvPrefix": "kvproc.store.types",
    "ResolvePolicy": "kvproc.store.types",
    "SaveClass": "kvproc.store.types",
    "SealCursor": "kvproc.store.types",
    "StoreConfig": "kvproc.store.types",
    "build_local_store": "kvproc.store.build",
    "ClusterStore": "kvproc.store.cluster",
    # what the reference engine needs from a model (beyond the contract)
    "EngineModel": "kvproc.engine.model_protocol",
    "RankedEngineModel": "kvproc.engine.model_protocol",
    "RankStep": "kvproc.engine.model_protocol",
    "SeqBatchItem": "kvproc.engine.models.base",
    # kvproc check: prove a model's contract
    "check_model": "kvproc.check.api",
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
    from kvproc.contract import (
        ArenaId,
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
    from kvproc.check.api import check_model
    from kvproc.core.bounded import CopyKind, CopyOrder
    from kvproc.core.hashing import DEFAULT_SCOPE, PAD_TOKEN_ID, BlockHasher, HashAlgorithm, HashScope, PageHashes
    from kvproc.core.holds import HoldConsumedError, MissReason, Pin, PrefixHold, Reservation, ReusePolicy, align_holds
    from kvproc.core.ownership import ForeignHandleError
    from kvproc.core.paged import PoolExhaustedError, StaleBlockError
    from kvproc.core.pool import BlockPool
    from kvproc.engine.model_protocol import EngineModel, RankedEngineModel, RankStep
    from kvproc.engine.models.base import SeqBatchItem
    from kvproc.core.request_kv import LifetimeExceededError, RequestKv, RequestStateError
    from kvproc.ipc.cancel import CancelToken
    from kvproc.runtime import launch
    from kvproc.store.build import build_local_store
    from kvproc.store.cluster import ClusterStore
    from kvproc.store.handoff import (
        FingerprintMismatch,
        HandoffEnvelope,
        chain_key,
        check_envelope,
        check_fingerprint,
        fingerprint,
        handoff_resolve_policy,
        model_label,
        padded_chain,
    )
    from kvproc.store.kv_store import KvStore
    from kvproc.store.types import (
        HandoffUnavailable,
        InvalidSealCursor,
        KvPrefix,
        ResolvePolicy,
        SaveClass,
        SealCursor,
        StoreConfig,
    )
