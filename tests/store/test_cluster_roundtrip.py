"""The store's verbs across real processes: host tier and copy worker as children, arenas and the host arena in
shared memory, every request over real sockets. The same rules in-process are in `test_store_contract.py`."""

from __future__ import annotations

import time

import pytest
import torch

from kvproc import KvContractError, RequestKv
from kvproc.ipc import messages as m
from kvproc.ipc.errors import RemoteError
from kvproc.store.cluster import ClusterStore
from kvproc.store.types import FULL_HIT, SaveClass
from kvproc.tiers.host_index import SaveTicket
from tests.conftest import ShmBytesModel, churn, cluster_store, compute, load_reasons, stopped

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("mover", ["memmove", "torch"])
def test_round_trip_restores_every_group_bit_for_bit(mover: str) -> None:
    """Save, evict, restore and the bounded group's seal / restore copies, in a real copy worker: with its default
    mover, and with the torch mover (`AttachArenas.mover`: the GPU path's executor over torch tensors, on CPU)."""
    with cluster_store(bounded=True, copy_mover="" if mover == "memmove" else mover) as (cs, store, model):
        toks = list(range(1, 17))
        kv, cur, _, written = compute(store, model, "a", toks)
        (seal,) = kv.seal_by_copy()  # checkpoint the bounded state at the 16-token boundary (via the worker)
        live = kv.live_slots["state"]
        model.slot(0, live)[:] = 7
        model.slot(1, live)[:] = 9
        store.execute_copies(0, [seal])
        store.retire(0, kv, cur)
        store.flush_saves(0, 10)
        assert store.stats()["store"].get("save_ok") == 1
        churn(store)
        model.zero()
        pre = store.resolve_prefix_sync(0, "b", toks + [1])
        assert pre.host_tokens == 16 and pre.device_tokens == 0
        for i, b in enumerate(pre.hold.block_ids):
            exp = written[pre.hold.hashes[i]]
            assert torch.equal(model.block(0, b), exp[0]) and torch.equal(model.block(1, b), exp[1])
        kv2 = RequestKv(store.pools[0], "b", toks + [1], 1)
        assert kv2.try_admit(pre.hold.num_blocks)
        store.execute_copies(0, kv2.match_and_add_prefix(pre.hold))  # staging slot -> live slot, in the worker
        live2 = kv2.live_slots["state"]
        assert (model.slot(0, live2) == 7).all() and (model.slot(1, live2) == 9).all()
        kv2.release()
        st = store.stats()
        assert st["rank0"]["active_blocks"] == 0 and st["tier"]["open_leases"] == 0
        worker = cs.cluster.client("copy_worker").request(m.Stats(), timeout=5).counters
        assert worker["orders_save"] == 1 and worker["orders_load"] == 1 and worker["orders_device"] == 2
        # every order named its mover (kvproc/workers/movers.py): all four by the one this worker was asked for
        assert worker[f"mover_orders.{mover}"] == 4 and "mover_orders.cma" not in worker
        assert worker[f"mover_bytes.{mover}"] == worker["bytes_save"] + worker["bytes_load"] + worker["bytes_device"]
        other = "torch" if mover == "memmove" else "memmove"
        assert f"mover_orders.{other}" not in worker


@pytest.mark.parametrize("mover", ["memmove", "torch"])
def test_a_repacking_model_round_trips_through_the_workers_repack(mover: str) -> None:
    with cluster_store(stored=True, repack="tests.conftest:xor_repack", copy_mover="" if mover == "memmove" else mover
                       ) as (cs, store, model):
        toks = list(range(1, 10))
        kv, cur, _, written = compute(store, model, "a", toks)
        store.retire(0, kv, cur)
        store.flush_saves(0, 10)
        churn(store)
        model.zero()
        pre = store.resolve_prefix_sync(0, "b", toks)
        assert pre.host_tokens == 8
        for i, b in enumerate(pre.hold.block_ids):
            assert torch.equal(model.block(0, b), written[pre.hold.hashes[i]][0])
            assert torch.equal(model.block(1, b), written[pre.hold.hashes[i]][1])
        pre.hold.release()
        worker = cs.cluster.client("copy_worker").request(m.Stats(), timeout=5).counters
        assert worker[f"mover_orders.{mover}"] == worker["orders_save"] + worker["orders_load"] >= 2


def test_a_failing_load_hook_is_a_counted_miss_by_arena_never_wrong_kv() -> None:
    """Issue 18: the hook raising on LOAD is not a quiet "no host hit": the worker counts it per arena (what `kvproc
    console status` shows), the store records the load as failed, and the request recomputes."""
    with cluster_store(stored=True, repack="tests.conftest:xor_repack_failing_loads") as (cs, store, model):
        toks = list(range(1, 10))
        kv, cur, _, _ = compute(store, model, "a", toks)
        store.retire(0, kv, cur)
        store.flush_saves(0, 10)
        churn(store)
        pre = store.resolve_prefix_sync(0, "b", toks)
        assert pre.host_tokens == 0 and pre.hold.num_blocks == 0  # nothing of the failed load is offered
        pre.hold.release()
        worker = cs.cluster.client("copy_worker", 0).request(m.Stats(), timeout=5).counters
        assert worker["repack_failed.kv0"] >= 1 or worker["repack_failed.kv1"] >= 1, worker
        assert load_reasons(store, "b") == ["repack_failed"]  # the outcome names the cause, not a transport error


def test_a_stored_layout_without_a_repack_path_is_refused_at_attach() -> None:
    with ClusterStore.start(1 << 20) as cs:
        model = ShmBytesModel(cs.allocator, 8, stored=True)
        with pytest.raises(KvContractError, match="repack="):
            cs.attach_model(model, live_slots=1)


def test_arenas_outside_shared_memory_are_refused_with_a_clear_error() -> None:
    with ClusterStore.start(0) as cs:
        model = ShmBytesModel(lambda name, n: torch.zeros(n, dtype=torch.uint8), 8)
        with pytest.raises(KvContractError, match="allocator=cs.allocator"):
            cs.attach_model(model, live_slots=1)


def test_without_host_bytes_only_the_copy_worker_runs_and_bounded_copies_go_through_it() -> None:
    with cluster_store(0, bounded=True) as (cs, store, model):
        assert store.tier is None and [k for k in cs.cluster._order] == [("copy_worker", 0)]
        kv, cur, _, _ = compute(store, model, "a", list(range(1, 17)))
        (seal,) = kv.seal_by_copy()
        model.slot(0, kv.live_slots["state"])[:] = 3
        store.execute_copies(0, [seal])
        store.retire(0, kv, cur)
        pre = store.resolve_prefix_sync(0, "b", list(range(1, 18)))
        assert pre.device_tokens == 16
        pre.hold.release()


def test_a_second_engine_joins_with_the_same_fingerprint_and_a_different_one_is_refused() -> None:
    with cluster_store() as (cs, store, model):
        client = cs.cluster.client("host_tier")
        assert store.tier is not None
        from kvproc.store.cluster import fingerprint
        from kvproc.tiers.host import layout_to_wire

        fp = fingerprint(model, store.layouts[0])
        again = client.request(m.Configure(fp, layout_to_wire(store.tier.layout)), timeout=5)
        assert again.segment == cs.host_segment
        with pytest.raises(RemoteError, match="fingerprint_mismatch") as e:
            client.request(m.Configure("other-model", layout_to_wire(store.tier.layout)), timeout=5)
        assert fp in str(e.value) and "other-model" in str(e.value)


def test_a_layout_larger_than_the_tiers_budget_is_refused_clearly() -> None:
    with ClusterStore.start(8192) as cs:
        model = ShmBytesModel(cs.allocator, 8, bounded=True)  # 4 regions of >= 4 KiB cannot fit 8 KiB
        with pytest.raises(RemoteError, match="too_large.*host_bytes=8192"):
            cs.attach_model(model, live_slots=1)


def test_a_host_hit_extends_a_device_hit() -> None:
    with cluster_store(num_blocks=16) as (cs, store, model):
        kv, cur, _, _ = compute(store, model, "a", list(range(33)))
        store.retire(0, kv, cur)
        store.flush_saves(0, 10)
        pool = store.pools[0]
        with pool.lock:  # evict the tail of the chain on the device only
            ids = pool.paged.allocate(len(pool.paged.free) + 5)
            pool.paged.release(ids)
        pre = store.resolve_prefix_sync(0, "b", list(range(33)))
        assert pre.device_tokens == 12 and pre.host_tokens == 20
        pre.hold.release()


def test_loading_is_waited_through_until_the_other_save_commits() -> None:
    with cluster_store() as (cs, store, model):
        tier = store.tier
        assert tier is not None
        hashes = RequestKv(store.pools[0], "x", list(range(17)), 0).page_hashes
        # another engine's save of this prefix is in flight on the shared tier
        ticket = store._loop.submit(tier.reserve_save("other", hashes, [], SaveClass.CACHEABLE, timeout=5)).result()
        assert isinstance(ticket, SaveTicket)
        fut = store.submit_resolve(0, "b", list(range(17)))
        time.sleep(0.2)
        assert not fut.done()  # the tier answered Loading; the store waits for the tier's notification
        assert store._loop.submit(tier.commit_save(ticket.save_id, timeout=5)).result()
        pre = fut.result(5)
        assert pre.host_tokens == 16  # (bytes were never written: the other engine's copy is not simulated)
        pre.hold.release()
        assert store.outcomes.for_request("b", "resolve")[-1].state == "ok"


def test_full_hit_mode_waits_through_misses_until_the_producers_save_lands() -> None:
    with cluster_store() as (cs, store, model):
        toks = list(range(16))
        fut = store.submit_resolve(0, "dec", toks, policy=FULL_HIT)
        time.sleep(0.2)
        assert not fut.done()
        kv, cur, _, _ = compute(store, model, "prod", toks)
        store.retire(0, kv, cur, SaveClass.HANDOFF)
        pre = fut.result(5)
        assert pre.hit_tokens == 16
        pre.hold.release()


def test_handoff_retire_parks_the_kv_until_its_saves_settle() -> None:
    with cluster_store() as (cs, store, model):
        kv, cur, _, _ = compute(store, model, "a", list(range(17)))
        with stopped(cs.cluster.pid("copy_worker")):  # the save's copy cannot land while the worker is stopped
            store.retire(0, kv, cur, SaveClass.HANDOFF)
            time.sleep(0.1)
            assert not kv.released and store.parked(0) == ["a"]
        store.flush_saves(0, 10)
        assert kv.released and store.parked(0) == []
        st = store.stats()
        assert st["tier"]["open_handoffs"] == 1 and st["rank0"]["pinned_blocks"] == 0
        store.tier.revoke_handoff("a")  # type: ignore[union-attr]


def test_a_waiter_gets_a_negative_answer_at_its_deadline_not_a_timeout() -> None:
    with cluster_store() as (cs, store, model):
        client = cs.cluster.client("host_tier")
        t0 = time.monotonic()
        assert client.request(m.WaitKey(b"never"), timeout=0.3) == m.Waited(False)
        assert 0.25 < time.monotonic() - t0 < 1.0


def test_a_workers_hook_that_disagrees_with_the_models_repack_is_refused_at_attach() -> None:
    """Issue 18, "one hook, written twice": the model repacks with `xor_repack`; a path to another function (a stale
    copy) is refused before any process is configured, naming both."""
    with ClusterStore.start(1 << 20) as cs:
        model = ShmBytesModel(cs.allocator, 8, stored=True)
        with pytest.raises(KvContractError, match="disagree on arena 'kv0'"):
            cs.attach_model(model, live_slots=1, repack="tests.conftest:xor_repack_stale_copy")
