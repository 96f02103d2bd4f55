"""Building a store for a model: validate its contract, then wire pools, tier and copy workers.

`build_local_store` puts the host tier and the copy path inside the scheduler process (no process boundary); the
multi-process topology is `kvproc.store.cluster.ClusterStore.start(...).attach_model(...)`.
"""

from __future__ import annotations

from kvproc.contract import ArenaLayout, KvModel, RepackHook, check_repack_hook, validate_layout
from kvproc.core.eviction import HOST_DEFAULT
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
                      config: StoreConfig = StoreConfig(), bounded_fraction: float = 0.25, ranks: int = 1) -> KvStore:
    """A store of `ranks` ranks whose host tiers (if `host_bytes`: one per rank, `host_bytes` each; one in all for a
    REPLICATED model) and copy paths live in this process."""
    layouts = [validate_layout(model.spec(), model.arenas(r)) for r in range(ranks)]
    if not host_bytes:
        # No tier, but bounded seal/restore copies still need a copy path (device -> device).
        return KvStore(layouts, live_slots=live_slots, copiers=[LocalCopier(CopyExecutor(lay)) for lay in layouts],
                       config=config)
    required = [g.name for g in layouts[0].spec.restorable_bounded_groups if not g.optional]
    layouts[0].spec.check_sharding(ranks)
    shared = ranks > 1 and layouts[0].spec.replicated  # stored once: every rank's copier reaches rank 0's tier
    tiers: list[LocalTier] = []
    copiers: list[LocalCopier] = []
    for layout in layouts:
        if shared and tiers:
            tier, host_layout = tiers[0], tiers[0].layout.for_layout(layout)
        else:
            host_layout = HostLayout.plan(layout, host_bytes, bounded_fraction)
            tier = LocalTier(host_layout, required, eviction=config.eviction or HOST_DEFAULT)
        tiers.append(tier)
        copiers.append(LocalCopier(CopyExecutor(layout, tier.host, host_layout, model_repack(model, layout))))
    return KvStore(layouts, live_slots=live_slots, tiers=tiers, copiers=copiers, config=config)
