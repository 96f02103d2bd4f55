"""`StoreConfig.eviction` and `kvproc up --eviction` (by default LRU for device pools, lrfu for host tiers): the policy
reaches the store's device pools and the host tier's index in its own process (read back from the tier's
`Configured`, which names the policy its `HostIndex` was built with); a shared tier keeps its own; an unknown name is
refused before anything starts."""

from __future__ import annotations

import pytest

from kvproc.core.eviction import FrequencyRecency, RunLru
from kvproc.runtime.standalone import up_main
from kvproc.store.build import build_local_store
from kvproc.store.cluster import ClusterStore
from kvproc.store.types import StoreConfig
from tests.conftest import cluster_store, kvproc_up
from tests.store.conftest import BytesModel, SharedMemoryModel

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("eviction", ["lru", "lrfu"])
def test_store_config_eviction_reaches_the_device_pool_and_the_tier_process(eviction: str) -> None:
    with cluster_store(config=StoreConfig(resolve_deadline_s=3.0, eviction=eviction)) as (cs, store, _):
        assert cs.tier_evictions == [eviction]  # the tier process's HostIndex, as its Configured says
        policy = store.pools[0].paged.inactive
        if eviction == "lru":
            assert isinstance(policy, RunLru)
        else:  # lrfu: decayed counts kept by content
            assert isinstance(policy, FrequencyRecency) and policy.sketch is not None and policy.lam > 0


def test_by_default_device_pools_evict_by_lru_and_host_tiers_by_lrfu() -> None:
    """None (the default) is each layer's own: the tier a store's cluster started, an in-process tier and a shared
    `kvproc up` tier all rank by lrfu; the store's device pools by LRU (`kvproc.core.eviction`, why)."""
    with cluster_store(config=StoreConfig(resolve_deadline_s=3.0)) as (cs, store, _):
        assert cs.tier_evictions == ["lrfu"]
        assert isinstance(store.pools[0].paged.inactive, RunLru)
    local = build_local_store(BytesModel(16), live_slots=2, host_bytes=1 << 16)
    try:
        index = local.tier.index  # type: ignore[union-attr]  # build_local_store's tiers are LocalTiers
        assert index.eviction == "lrfu" and isinstance(index.lru, FrequencyRecency) and index.lru.lam > 0
        assert isinstance(local.pools[0].paged.inactive, RunLru)
    finally:
        local.close()
    with kvproc_up("evictd") as (rd, _):
        with ClusterStore.start(1 << 20, tier_runtime_dir=rd) as cs:
            cs.attach_model(SharedMemoryModel(cs.allocator), live_slots=2)
            assert cs.tier_evictions == ["lrfu"]


def test_a_shared_kvproc_up_tier_keeps_its_own_eviction() -> None:
    with kvproc_up("evictt", "--eviction", "lfu") as (rd, _):
        with ClusterStore.start(1 << 20, tier_runtime_dir=rd) as cs:
            store = cs.attach_model(SharedMemoryModel(cs.allocator), live_slots=2,
                                    config=StoreConfig(eviction="lrfu"))
            assert cs.tier_evictions == ["lfu"]  # several stores share it: theirs do not change it
            assert isinstance(store.pools[0].paged.inactive, FrequencyRecency)  # the store's own pool: its config


def test_an_in_process_tier_evicts_by_the_store_s_policy() -> None:
    store = build_local_store(BytesModel(16), live_slots=2, host_bytes=1 << 16, config=StoreConfig(eviction="lfu"))
    try:
        index = store.tier.index  # type: ignore[union-attr]  # build_local_store's tiers are LocalTiers
        assert index.eviction == "lfu" and isinstance(index.lru, FrequencyRecency) and index.lru.lam == 0
    finally:
        store.close()


def test_an_unknown_eviction_policy_is_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="StoreConfig.eviction must be one of lru, lfu, lrfu, got 'arc'"):
        StoreConfig(eviction="arc")
    with pytest.raises(SystemExit) as e:
        up_main(["--eviction", "arc"])
    assert e.value.code == 2 and "invalid choice: 'arc'" in capsys.readouterr().err
