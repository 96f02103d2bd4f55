"""Building a store for a model: validate its contract, then wire pools, tier and copy workers.

`build_local_store` puts the host tier and the copy path inside the scheduler process (no process boundary); the
multi-process topology is `kvproc.store.cluster.ClusterStore.start(...).attach_model(...)`.
"""

from __future__ import annotations

from kvproc.contract import ArenaLayout, KvModel, RepackHook, check_repack_hook, validate_layout
from kvproc.store.kv_store import KvStore
from kvproc.store.local_tier import LocalCopier, LocalTier
from kvproc.store.types import StoreConfig
from kvproc.tiers.layout import HostLayout
from kvproc.workers.copy_exec import CopyExecutor

RepackFn = RepackHook


def model_repack(model: KvModel, layout: ArenaLayout) -> RepackFn | None:
    """The model's repack hook if any arena declares a stored layout, else None (plain byte copies)."""
    if layout.repacked_arenas:
        return check_repack_hook(model.repack, type(model).__name__)
    return None


def build_local_store(model: KvModel, *, live_slots: int, host_bytes: int | None = None,
                      config: StoreConfig = StoreConfig(), bounded_fraction: float = 0.25) -> KvStore:
    """A store for one rank whose host tier (if `host_bytes`) lives in this process."""
    layout = validate_layout(model.spec(), model.arenas(0))
    if not host_bytes:
        # No tier, but bounded seal/restore copies still need a copy path (device -> device).
        return KvStore([layout], live_slots=live_slots, copiers=[LocalCopier(CopyExecutor(layout))], config=config)
    host_layout = HostLayout.plan(layout, host_bytes, bounded_fraction)
    required = [g.name for g in layout.spec.restorable_bounded_groups if not g.optional]
    tier = LocalTier(host_layout, required)
    copier = LocalCopier(CopyExecutor(layout, tier.host, host_layout, model_repack(model, layout)))
    return KvStore([layout], live_slots=live_slots, tier=tier, copiers=[copier], config=config)
