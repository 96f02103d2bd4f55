"""The reference engine on two nodes sharing one Mooncake Store: a conversation's first turn runs on node A, its next
turn on node B, whose host tier never saw it. B's prefix comes from Mooncake (through its own host tier), and the
tokens and logits equal the same turns run without any cache. `hybrid` checkpoints bounded state too: its artifacts
travel with their pages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvproc.engine.engine import Engine
from kvproc.engine.pd import PdRouter
from kvproc.engine.request import Request
from kvproc.engine.topology import PoolSizes, Topology, make_store
from kvproc.engine.workload import drive
from kvproc.store.cluster import ClusterStore
from kvproc.store.types import StoreConfig
from kvproc.tiers.mooncake_local import LocalMooncake
from tests.conftest import MooncakeNamespace, kvproc_up, remote_stats, wait_for, written_behind
from tests.engine.test_engine_pd import SPEC, engine_on, single_engine_outputs

pytestmark = pytest.mark.timeout(120)

FIRST, NEW, OUT = 64, 32, 8
TOL = {"rtol": 1e-4, "atol": 1e-4}
SIZES = PoolSizes(device_blocks=64, live_slots=2, staging_slots=8, host_bytes=8 << 20)


def _node(model: str, remote: str | None) -> Topology:
    if remote is None:
        return make_store("no_cache", model, SIZES, seed=3)
    return make_store("kvproc", model, SIZES, seed=3, processes=True, remote=remote,
                      config=StoreConfig(cacheable_pin_fraction=1.0))


def _turn(t: Topology, rid: str, prompt: np.ndarray) -> Request:
    eng = Engine(t.model, t.store, max_batch=1, chunk_tokens=48, checkpoint_every_pages=2,
                 prefix_cache=t.prefix_cache)
    req = Request.make(rid, prompt, OUT, keep_logits=True)
    eng.run([req])
    assert req.failed is None, req.failed
    t.store.flush_saves(0)
    return req


# hybrid: paged pages and bounded checkpoint artifacts both travel (dense adds nothing the store tests do not cover)
@pytest.mark.parametrize("model", ["hybrid"])
def test_a_conversation_continued_on_another_node_is_served_from_mooncake(mooncake: MooncakeNamespace,
                                                                          model: str) -> None:
    rng = np.random.default_rng(11)
    first = rng.integers(2, 200, FIRST)
    new = rng.integers(2, 200, NEW)
    with _node(model, None) as t:
        r0 = _turn(t, "t0", first)
        ref = _turn(t, "t1", np.concatenate([first, r0.output, new]))
    with _node(model, mooncake.url) as a, _node(model, mooncake.url) as b:
        a0 = _turn(a, "t0", first)
        assert a0.output == r0.output
        written_behind(a.store, FIRST // 16)
        got = _turn(b, "t1", np.concatenate([first, a0.output, new]))
        assert got.host_hit_tokens > 0 and got.device_hit_tokens == 0  # B's own tiers had nothing
        assert remote_stats(b.store)["pulled_pages"] > 0
    assert got.output == ref.output
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(ref.logits), **TOL)


@pytest.mark.parametrize("barrier", [True, False], ids=["barrier", "no_barrier"])
def test_pd_across_nodes_through_mooncake_equals_a_single_engine(mooncake: MooncakeNamespace, barrier: bool) -> None:
    """Prefill on node A, decode on node B (each its own host tier): A's hand-off saves are written through to
    Mooncake, B's full-hit resolve pulls them through its own host tier. With the KV-ready barrier an envelope is
    emitted once its saves are in Mooncake; without it B may ask first, and its full-hit wait is answered when the
    pages land in Mooncake (B's host tier re-probes for the awaited key). Tokens equal one engine's; no hand-off pin
    or lease is left on either node."""
    want = single_engine_outputs("dense")
    with ClusterStore.start(16 << 20, remote=mooncake.url) as p, ClusterStore.start(16 << 20, remote=mooncake.url) as d:
        prefill, decode = engine_on(p, "dense", handoff_barrier=barrier), engine_on(d, "dense")
        router = PdRouter(prefill, decode)
        recs = drive(router, SPEC, prefill.model.vocab_size)
        assert all(r.failed is None for r in recs), [r.failed for r in recs]
        assert sorted((r.conversation, r.turn, r.output) for r in recs) == want
        assert decode.counters["handoffs_adopted"] == SPEC.total_turns
        assert router.counters["handoffs_rejected"] == 0  # no decode ran ahead of Mooncake
        assert p.store is not None and d.store is not None
        written_behind(p.store, 1)
        tier_p, tier_d = p.store.stats()["tier"], d.store.stats()["tier"]
        for tier in (tier_p, tier_d):
            assert tier["open_handoffs"] == 0 and tier["open_leases"] == 0, tier
        rp = remote_stats(p.store)
        assert rp["handoffs_written_through"] >= SPEC.total_turns and rp.get("handoff_write_through_failed", 0) == 0
        rd = remote_stats(d.store)
        assert rd["pulled_pages"] > 0


@pytest.mark.parametrize("victim", ["storage", "master"])
def test_handoffs_committed_while_mooncake_is_down_are_answered_counted_and_served_on_their_node(
        own_mooncake: LocalMooncake, victim: str) -> None:
    """Mooncake dies before the prefill node's hand-offs commit, and nobody has noticed yet (the breaker is closed:
    the first write-through really goes out and fails). Every commit is answered within its deadline, the failures
    are counted, each hand-off stays pinned in the node's own host tier, and P/D on that node (prefill and decode
    sharing its tier, with the KV-ready barrier) keeps serving: tokens equal one engine's, nothing left pinned."""
    want = single_engine_outputs("dense")
    with kvproc_up("mcdown", "--host-mib", "64", "--remote", own_mooncake.url + "&timeout=1") as (rd, _), \
            ClusterStore.start(16 << 20, tier_runtime_dir=rd) as p, ClusterStore.start(16 << 20, tier_runtime_dir=rd) as d:
        prefill, decode = engine_on(p, "dense", handoff_barrier=True), engine_on(d, "dense")
        assert p.store is not None
        wait_for(lambda: remote_stats(p.store).get("connected") == 1, 10, "the tier connected to Mooncake")
        (own_mooncake.kill_master if victim == "master" else own_mooncake.kill_storage)()
        router = PdRouter(prefill, decode)
        recs = drive(router, SPEC, prefill.model.vocab_size)
        assert all(r.failed is None for r in recs), [r.failed for r in recs]
        assert sorted((r.conversation, r.turn, r.output) for r in recs) == want
        assert decode.counters["handoffs_adopted"] == SPEC.total_turns
        # Each hand-off's commit was answered (the barrier emitted every envelope) and its save stands.
        assert p.store.stats()["store"].get("handoff_save_failed", 0) == 0
        wait_for(lambda: remote_stats(p.store).get("handoff_write_through_failed", 0) >= SPEC.total_turns, 15,
                 "every write-through's failure counted")
        st = remote_stats(p.store)
        assert st.get("handoffs_written_through", 0) == 0 and st["breaker_opened"] >= 1, st
        # A real call found Mooncake down, not only skipped: the first write-through (failed, or ran out its
        # deadline) or, where a resolve's host-tier miss asked Mooncake first (a loaded machine), that probe.
        assert sum(st.get(f"ops_writes_{o}", 0) for o in ("ok", "failed", "timeout")) \
            + st.get("probes_failed", 0) + st.get("probes_timeout", 0) >= 1, st
        tier = p.store.stats()["tier"]
        assert tier["open_handoffs"] == 0 and tier["open_leases"] == 0 and tier["waiters"] == 0, tier
