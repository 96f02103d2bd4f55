"""`Sharding.REPLICATED` means what it says: a model whose every rank holds the same KV is stored once (rank 0 saves,
into one tier) and restored on any rank from that one copy, bit for bit; `PER_RANK` keeps a copy per rank in the
rank's own tier. The fingerprints tell the two apart, and a spec mixing them is refused for a multi-rank store."""

from __future__ import annotations

import pytest
import torch

from kvproc import GroupKind, GroupSpec, KvContractError, KvSpec, RequestKv, Sharding
from kvproc.contract import validate_layout
from kvproc.core.hashing import HashAlgorithm
from kvproc.store import cluster
from kvproc.store.build import build_local_store
from kvproc.store.cluster import ClusterStore
from kvproc.store.handoff import fingerprint
from kvproc.store.kv_store import KvStore
from kvproc.store.types import SealCursor
from tests.conftest import descendants
from tests.store.conftest import RankShardModel as Model

pytestmark = pytest.mark.timeout(120)
PAGE, BLOCK = 4, 64
TOKS = list(range(9))  # two full pages


def _spec(*shardings: Sharding) -> KvSpec:
    groups = tuple(GroupSpec(f"g{i}", GroupKind.PAGED, s) for i, s in enumerate(shardings))
    return KvSpec(PAGE, groups, model_id="tests-replicated-model")


def _compute_and_retire(store: KvStore, model: Model, rank: int) -> list[torch.Tensor]:
    """Rank `rank` computes TOKS: the same bytes on every rank (each page's bytes depend on the page, not the rank)."""
    kv = RequestKv(store.pools[rank], f"a{rank}", TOKS, 1)
    assert kv.try_admit(0)
    kv.schedule(len(TOKS))
    for page, b in enumerate(kv.block_ids):
        model.block(rank, b)[:] = torch.arange(BLOCK, dtype=torch.uint8) * (page + 3)
    kv.apply()
    pages = [model.block(rank, b).clone() for b in kv.block_ids[: len(TOKS) // PAGE]]
    store.retire(rank, kv, SealCursor.after_prefix(0))
    store.flush_saves(rank, 30)
    return pages


def _restore(store: KvStore, model: Model, rank: int) -> tuple[int, list[torch.Tensor]]:
    """Rank `rank`'s device cache emptied, its arena zeroed, then a resolve: (host tokens, the restored pages)."""
    store.drop_device_cache(rank)
    for _, arena in model.arenas(rank):
        arena.tensor.zero_()
    pre = store.resolve_prefix_sync(rank, f"b{rank}", TOKS)
    pages = [model.block(rank, b).clone() for b in pre.hold.block_ids]
    pre.hold.release()
    return pre.host_tokens, pages


def _tier_keys(store: KvStore) -> list[str]:
    return sorted(k for k in store.stats() if k.startswith("tier") and k != "tier_available")


@pytest.mark.parametrize("ranks", [2, 4])
def test_replicated_is_stored_once_and_restored_on_every_rank(ranks: int) -> None:
    """Every rank computes (lock step): rank 0 saves, the others save nothing; one tier holds the pages once; every
    rank restores them from it byte for byte. PER_RANK, for contrast, keeps `ranks` copies in `ranks` tiers."""
    before = descendants()
    for sharding in (Sharding.REPLICATED, Sharding.PER_RANK):
        with ClusterStore.start(1 << 20, ranks=ranks) as cs:
            model = Model(_spec(sharding), ranks, cs.allocator)
            store = cs.attach_model(model, live_slots=1)
            written = [_compute_and_retire(store, model, r) for r in range(ranks)]
            stats = store.stats()
            entries = sum(stats[k]["entries"] for k in _tier_keys(store))
            if sharding is Sharding.REPLICATED:
                assert _tier_keys(store) == ["tier"] and entries == 2, stats  # one copy of the two pages
                assert stats["store"]["seal_replicated_by_saver"] == ranks - 1
                assert stats["store"].get("save_ok", 0) == 1  # rank 0's save only
            else:
                assert len(_tier_keys(store)) == ranks and entries == 2 * ranks  # a copy per rank
            for r in range(ranks):
                host, pages = _restore(store, model, r)
                assert host == 8, (sharding, r)
                assert all(torch.equal(a, b) for a, b in zip(pages, written[0], strict=True))
            assert store.stats()["tier"]["open_leases"] == 0
    assert not descendants() - before


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_page_saved_by_rank_0_restores_on_a_rank_that_never_computed_it(ranks: int) -> None:
    """Restorable on ANY rank: only rank 0 computes; every other rank's resolve loads rank 0's copy. Under PER_RANK
    the other ranks' tiers hold nothing and they miss (what REPLICATED must not do)."""
    for sharding, want in ((Sharding.REPLICATED, 8), (Sharding.PER_RANK, 0)):
        with ClusterStore.start(1 << 20, ranks=ranks) as cs:
            model = Model(_spec(sharding), ranks, cs.allocator)
            store = cs.attach_model(model, live_slots=1)
            written = _compute_and_retire(store, model, 0)
            for r in range(1, ranks):
                host, pages = _restore(store, model, r)
                assert host == want, (sharding, r)
                if want:
                    assert all(torch.equal(a, b) for a, b in zip(pages, written, strict=True))


def test_replicated_in_process_store_at_four_ranks_shares_one_tier() -> None:
    model = Model(_spec(Sharding.REPLICATED, Sharding.REPLICATED), 4)
    with build_local_store(model, live_slots=1, host_bytes=1 << 20, ranks=4) as store:
        assert len({id(t) for t in store.tiers}) == 1 and len(store.tiers) == 4
        written = _compute_and_retire(store, model, 0)
        for r in range(4):
            host, pages = _restore(store, model, r)
            assert host == 8 and all(torch.equal(a, b) for a, b in zip(pages, written, strict=True))
        assert _tier_keys(store) == ["tier"] and store.stats()["tier"]["entries"] == 2


def test_fingerprints_tell_replicated_from_per_rank() -> None:
    fps = {}
    for sharding in Sharding:
        model = Model(_spec(sharding), 1)
        layout = validate_layout(model.spec(), model.arenas(0))
        fps[sharding] = (fingerprint("m", layout, HashAlgorithm.BLAKE2B_128),
                         cluster.fingerprint(model, layout))  # type: ignore[arg-type]
    assert fps[Sharding.REPLICATED][0] != fps[Sharding.PER_RANK][0]  # P/D hand-off
    assert fps[Sharding.REPLICATED][1] != fps[Sharding.PER_RANK][1]  # the tier an engine attaches to
    assert "g0:paged:replicated" in fps[Sharding.REPLICATED][0]


def test_a_spec_mixing_replicated_and_per_rank_is_refused_for_several_ranks_only() -> None:
    model = Model(_spec(Sharding.REPLICATED, Sharding.PER_RANK), 2)
    with pytest.raises(KvContractError, match=r"\['g0'\] are REPLICATED and \['g1'\] PER_RANK"):
        build_local_store(model, live_slots=1, host_bytes=1 << 20, ranks=2)
    build_local_store(model, live_slots=1, host_bytes=1 << 20, ranks=1).close()  # one rank: nothing to place
