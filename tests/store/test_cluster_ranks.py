"""Several ranks in one ClusterStore: a copy worker and a host tier per rank (a tier's index has no rank in its keys, so
each rank's shard lives in its own tier). Each rank's bytes come back to that rank, bit for bit, also across a P/D
hand-off between two stores sharing per-rank tiers (`kvproc up --ranks N`)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kvproc import GroupKind, GroupSpec, KvSpec, RequestKv
from kvproc.ipc.segment import list_segments
from kvproc.store.cluster import ClusterStore
from kvproc.store.handoff import handoff_resolve_policy, padded_chain
from kvproc.store.kv_store import KvStore
from kvproc.store.types import SaveClass, SealCursor
from tests.conftest import descendants
from tests.store.conftest import RankShardModel

# Unique to this test process: the segment checks below count by cluster name, and another pytest run on the same
# machine (same /dev/shm) must not be counted.
RANKS2_CLUSTER = f"ranks2{os.getpid()}"

pytestmark = pytest.mark.timeout(90)
PAGE, BLOCK = 4, 64


def per_rank_model(cs: ClusterStore, ranks: int, num_blocks: int = 16) -> RankShardModel:
    """One paged group; each rank has its own arena (its shard) in the scheduler's shared memory."""
    spec = KvSpec(PAGE, (GroupSpec("kv", GroupKind.PAGED),), model_id="tests-ranks-model")
    return RankShardModel(spec, ranks, cs.allocator, num_blocks, BLOCK)


def _compute_and_retire(store: KvStore, model: RankShardModel, rank: int, toks: list[int]) -> dict[bytes, torch.Tensor]:
    kv = RequestKv(store.pools[rank], f"a{rank}", toks, 1)
    assert kv.try_admit(0)
    kv.schedule(len(toks))
    for b in kv.block_ids:
        model.block(rank, b)[:] = torch.full((BLOCK,), 10 * rank + b % 7, dtype=torch.uint8)  # rank-specific bytes
    kv.apply()
    written = {h: model.block(rank, b).clone() for h, b in zip(kv.page_hashes, kv.block_ids[: len(toks) // PAGE])}
    store.retire(rank, kv, SealCursor.after_prefix(0))
    store.flush_saves(rank, 10)
    return written


def test_two_ranks_each_restore_their_own_shard_from_their_own_tier() -> None:
    before = descendants()
    with ClusterStore.start(1 << 20, ranks=2) as cs:
        assert len({cs.cluster.pid("host_tier", r) for r in range(2)}) == 2  # a tier process per rank
        model = per_rank_model(cs, 2)
        store = cs.attach_model(model, live_slots=1)
        assert len(store.tiers) == 2 and store.tiers[0] is not store.tiers[1]
        toks = list(range(9))  # the same prompt on both ranks: the same page hashes, different shards
        written = {r: _compute_and_retire(store, model, r, toks) for r in range(2)}
        for r in range(2):
            with store.pools[r].lock:
                ids = store.pools[r].paged.allocate(store.pools[r].paged.available)
                store.pools[r].paged.release(ids)  # churn: the next resolve must come from the host tier
            model._arenas[r][0][1].tensor.zero_()
        for r in range(2):
            pre = store.resolve_prefix_sync(r, f"b{r}", toks)
            assert pre.host_tokens == 8, (r, pre)
            for h, b in zip(pre.hold.hashes, pre.hold.block_ids):
                assert torch.equal(model.block(r, b), written[r][h])  # rank r's bytes, not the other rank's
            pre.hold.release()
        stats = store.stats()
        assert stats["tier"]["open_leases"] == 0 and stats["tier1"]["open_leases"] == 0
    assert not descendants() - before


def test_pd_handoff_across_two_ranks_through_shared_per_rank_tiers() -> None:
    """`kvproc up --ranks 2` runs a host tier per rank; a 2-rank prefill store and a 2-rank decode store attach rank r
    to tier r. The producer (one request, sharded over both ranks) seals with HANDOFF on each rank; the consumer's
    full-hit resolve on each rank restores that rank's shard bit for bit and consumes that rank's hand-off. A store
    with more ranks than the shared cluster has tiers is refused with the command that fixes it."""
    rd = f"/tmp/kvup-r2{os.getpid()}"
    up = subprocess.Popen([sys.executable, "-m", "kvproc", "up", "--cluster", RANKS2_CLUSTER, "--runtime-dir", rd,
                           "--host-mib", "8", "--ranks", "2"], stdout=subprocess.PIPE, text=True)
    try:
        assert "up; manifest" in (up.stdout.readline() if up.stdout else "")
        with ClusterStore.start(1 << 20, ranks=3, tier_runtime_dir=rd) as three:  # PER_RANK: refused at attach
            with pytest.raises(RuntimeError, match=r"ranks \[0, 1\].*kvproc up --ranks 3"):
                three.attach_model(per_rank_model(three, 3), live_slots=1)
        with ClusterStore.start(1 << 20, ranks=2, tier_runtime_dir=rd) as P, \
                ClusterStore.start(1 << 20, ranks=2, tier_runtime_dir=rd) as D:
            mp, md = per_rank_model(P, 2), per_rank_model(D, 2)
            sp, sd = P.attach_model(mp, live_slots=1), D.attach_model(md, live_slots=1)
            assert P.host_segments == D.host_segments and len(set(P.host_segments)) == 2  # joined, one per rank
            toks = list(range(1, 11))  # 10 tokens: 2 full pages + a partial one padded to the boundary
            want: dict[int, dict[bytes, torch.Tensor]] = {}
            for r in range(2):
                kv = RequestKv(sp.pools[r], "prod", toks, 4)
                assert kv.try_admit()
                kv.schedule(len(toks))
                for b in kv.block_ids:
                    mp.block(r, b)[:] = torch.full((BLOCK,), 100 * r + b, dtype=torch.uint8)
                kv.apply()
                kv.pad_to_boundary()
                want[r] = {h: mp.block(r, b).clone() for h, b in zip(kv.page_hashes, kv.block_ids)}
                sp.retire(r, kv, SealCursor.after_prefix(0), SaveClass.HANDOFF)
            chain = padded_chain(toks, len(toks), PAGE)
            for r in range(2):
                pre = sd.resolve_prefix_sync(r, "dec", chain, policy=handoff_resolve_policy("prod", 3))
                assert pre.host_tokens == 12 and pre.device_tokens == 0, (r, pre)
                for h, b in zip(pre.hold.hashes, pre.hold.block_ids):
                    assert torch.equal(md.block(r, b), want[r][h])  # rank r's shard, not the other rank's
                pre.hold.release()
            stats = sd.stats()
            for key in ("tier", "tier1"):
                assert stats[key]["handoffs_consumed"] == 1 and stats[key]["open_handoffs"] == 0, (key, stats[key])
                assert stats[key]["open_leases"] == 0
    finally:
        subprocess.run([sys.executable, "-m", "kvproc", "down", "--runtime-dir", rd, "--timeout", "10"], check=False,
                       capture_output=True)
        up.wait(10)
    assert not list_segments(RANKS2_CLUSTER) and not os.path.exists(rd)


def test_two_ranks_without_a_host_tier_each_get_a_worker_and_their_own_prefix_cache() -> None:
    with ClusterStore.start(0, ranks=2) as cs:
        model = per_rank_model(cs, 2)
        store = cs.attach_model(model, live_slots=1)
        assert len({cs.cluster.pid("copy_worker", r) for r in range(2)}) == 2 and store.tiers == ()
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
        assert store.pools[0].stats()["active_blocks"] == 2 and store.pools[1].stats()["active_blocks"] == 2
        pre0.hold.release()
        pre1.hold.release()
        assert store.pools[0].stats()["active_blocks"] == store.pools[1].stats()["active_blocks"] == 0


def test_kvproc_up_gives_each_ranks_tier_its_own_tcp_port() -> None:
    from kvproc.runtime.standalone import _rank_tcp

    assert _rank_tcp("tcp://127.0.0.1:5555", 0) == "tcp://127.0.0.1:5555"
    assert _rank_tcp("tcp://127.0.0.1:5555", 2) == "tcp://127.0.0.1:5557"
    assert _rank_tcp("tcp://127.0.0.1:0", 3) == "tcp://127.0.0.1:0"  # any free port, per tier
    assert _rank_tcp(None, 1) is None
    with pytest.raises(SystemExit, match="tcp://HOST:PORT"):
        _rank_tcp("tcp://127.0.0.1:http", 1)


def test_cluster_store_pins_the_roles_and_ranks_it_is_told_to_and_refuses_unknown_names() -> None:
    """`ClusterStore.start(cpus=...)`: a role's entry applies to all its ranks, "role[rank]" wins for one rank."""
    first, last = min(os.sched_getaffinity(0)), max(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=r"cpus names \['tier'\]"):
        ClusterStore.start(1 << 20, cpus={"tier": [0]})
    cs = ClusterStore.start(1 << 20, ranks=2, cpus={"copy_worker": [last], "copy_worker[1]": [first]})
    try:
        assert os.sched_getaffinity(cs.cluster.pid("copy_worker", 0)) == {last}
        assert os.sched_getaffinity(cs.cluster.pid("copy_worker", 1)) == {first}
        assert os.sched_getaffinity(cs.cluster.pid("host_tier", 1)) == os.sched_getaffinity(0)
    finally:
        cs.close()
