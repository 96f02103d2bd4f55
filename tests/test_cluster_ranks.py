"""Several ranks in one ClusterStore: one copy worker process per rank. A shared host tier is refused (its index has
no rank in its keys); device-only caching and bounded-free copies work per rank."""

from __future__ import annotations

import pytest

from kvproc import GroupKind, GroupSpec, KvArena, KvSpec, RequestKv
from kvproc.cluster import ClusterStore
from kvproc.contract import KvContractError
from tests.test_cluster_fixtures import ShmBytesModel

pytestmark = pytest.mark.timeout(60)


class PerRankModel:
    """One paged group; each rank has its own arena in the scheduler's shared memory."""

    def __init__(self, cs: ClusterStore, ranks: int, num_blocks: int = 16) -> None:
        self._spec = KvSpec(4, (GroupSpec("kv", GroupKind.PAGED),))
        self._arenas = {r: [("kv", KvArena(f"kv_r{r}", cs.allocator(f"kv_r{r}", num_blocks * 64), num_blocks, 64, 64))]
                        for r in range(ranks)}

    def spec(self) -> KvSpec:
        return self._spec

    def arenas(self, rank: int) -> list[tuple[str, KvArena]]:
        return list(self._arenas[rank])


def test_two_ranks_sharing_one_host_tier_are_refused_at_attach() -> None:
    with ClusterStore.start(1 << 20, ranks=2) as cs:
        with pytest.raises(KvContractError, match="cannot share one host tier"):
            cs.attach_model(ShmBytesModel(cs.allocator, 8), live_slots=1)


def test_two_ranks_without_a_host_tier_each_get_a_worker_and_their_own_prefix_cache() -> None:
    with ClusterStore.start(0, ranks=2) as cs:
        model = PerRankModel(cs, 2)
        store = cs.attach_model(model, live_slots=1)
        assert len(store.pools) == 2 and len({cs.cluster.pid("copy_worker", r) for r in range(2)}) == 2
        toks = list(range(9))
        for r in range(2):
            kv = RequestKv(store.pools[r], f"a{r}", toks, 1)
            assert kv.try_admit(0)
            kv.schedule(len(toks))
            kv.apply()
            kv.release()
        pre0 = store.resolve_prefix_sync(0, "b", toks)
        pre1 = store.resolve_prefix_sync(1, "b", toks)
        assert pre0.device_tokens == pre1.device_tokens == 8 and pre0.host_tokens == pre1.host_tokens == 0
        # each rank's hold points into its own pool
        assert store.pools[0].stats()["active_blocks"] == 2 and store.pools[1].stats()["active_blocks"] == 2
        pre0.hold.release()
        pre1.hold.release()
        assert store.pools[0].stats()["active_blocks"] == store.pools[1].stats()["active_blocks"] == 0
