"""Faults across real processes: SIGKILL the copy worker during a load and during a save, and the host tier during a
query. Each time: the resolve returns within its deadline, nothing leaks (blocks, leases, pins, segments, processes),
and service resumes (a restarted copy worker is re-attached; a dead tier leaves a device-only store that keeps
serving). The worker is SIGSTOPped first so the call is provably in flight when the SIGKILL lands."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvproc import RequestKv
from kvproc.ipc import messages as m
from kvproc.store.types import SaveClass, StoreConfig
from tests.conftest import churn, cluster_store, compute, stopped, wait_for

pytestmark = pytest.mark.timeout(60)
# `submit_resolve` on the store loop, its calls awaited through the cluster's clients (whose pending calls these
# tests watch).
CONFIG = StoreConfig(resolve_deadline_s=3.0)


def _saved(store, model, rid: str, toks: list[int]) -> None:
    kv, cur, _, _ = compute(store, model, rid, toks)
    store.retire(0, kv, cur)
    store.flush_saves(0, 10)
    assert store.outcomes.for_request(rid)[-2].state == "ok"  # the save (the retire is recorded last)


def test_copy_worker_killed_during_a_load_degrades_frees_everything_and_service_resumes() -> None:
    with cluster_store(config=CONFIG) as (cs, store, model):
        toks = list(range(17))
        _saved(store, model, "a", toks)
        churn(store)
        worker = cs.cluster.pid("copy_worker")
        client = cs.cluster.client("copy_worker")
        with stopped(worker):
            t0 = time.monotonic()
            fut = store.submit_resolve(0, "b", toks)
            wait_for(lambda: client.pending_count > 0, what="the load order in flight")
            os.kill(worker, signal.SIGKILL)
            pre = fut.result(5)
        assert time.monotonic() - t0 < CONFIG.resolve_deadline_s
        assert pre.hit_tokens == 0
        assert store.outcomes.for_request("b", "resolve")[-1].reason == "load_failed"
        pre.hold.release()
        cs.cluster.wait_available("copy_worker", timeout=15)
        st = store.stats()
        assert st["rank0"]["active_blocks"] == 0
        wait_for(lambda: store.stats()["tier"]["open_leases"] == 0, what="the lease released")
        pre = store.resolve_prefix_sync(0, "c", toks)  # the new worker is re-attached before this load
        assert pre.host_tokens == 16
        assert store.copiers[0].attaches == 2  # type: ignore[attr-defined]
        pre.hold.release()
        assert store.stats()["rank0"]["active_blocks"] == 0


def test_copy_worker_killed_during_a_save_aborts_it_unpins_and_later_saves_work() -> None:
    with cluster_store(config=CONFIG) as (cs, store, model):
        worker = cs.cluster.pid("copy_worker")
        client = cs.cluster.client("copy_worker")
        kv, cur, _, _ = compute(store, model, "a", list(range(17)))
        with stopped(worker):
            store.retire(0, kv, cur, SaveClass.HANDOFF)
            wait_for(lambda: client.pending_count > 0, what="the save order in flight")
            os.kill(worker, signal.SIGKILL)
            store.flush_saves(0, 5)
        assert kv.released and store.parked(0) == []
        st = store.stats()
        assert st["store"]["handoff_save_failed"] == 1 and st["rank0"]["pinned_blocks"] == 0
        wait_for(lambda: store.stats()["tier"]["open_saves"] == 0, what="the save aborted in the tier")
        cs.cluster.wait_available("copy_worker", timeout=15)
        _saved(store, model, "b", [50 + i for i in range(17)])
        churn(store)
        pre = store.resolve_prefix_sync(0, "c", [50 + i for i in range(17)])
        assert pre.host_tokens == 16
        pre.hold.release()
        assert store.stats()["rank0"]["active_blocks"] == 0


def test_host_tier_killed_during_a_query_degrades_to_device_only_and_keeps_serving() -> None:
    with cluster_store(config=CONFIG) as (cs, store, model):
        kv, cur, _, _ = compute(store, model, "a", list(range(9)))
        store.retire(0, kv, cur)
        store.flush_saves(0, 10)
        tier_pid = cs.cluster.pid("host_tier")
        client = cs.cluster.client("host_tier")
        # The save's CommitSave is fire-and-forget: let its reply come first, or it would pass for the query below
        # (and the tier could die before the resolve even asks it: a "tier_unavailable" degrade instead).
        wait_for(lambda: client.pending_count == 0, what="the save's commit answered")
        with stopped(tier_pid):
            t0 = time.monotonic()
            fut = store.submit_resolve(0, "b", list(range(17)))
            wait_for(lambda: client.pending_count > 0, what="the query in flight")
            os.kill(tier_pid, signal.SIGKILL)
            pre = fut.result(5)
        assert time.monotonic() - t0 < CONFIG.resolve_deadline_s
        assert pre.device_tokens == 8 and pre.host_tokens == 0
        assert store.outcomes.for_request("b", "resolve")[-1].reason == "tier_PeerDeadError"
        pre.hold.release()
        wait_for(lambda: not store.tier.available, what="the tier marked unavailable")  # type: ignore[union-attr]
        assert store.stats()["tier_available"] is False
        # device-only from now on: resolves skip the tier, seals shed, nothing hangs
        kv2, cur2, pre2, _ = compute(store, model, "c", list(range(17)))
        assert pre2.device_tokens == 8
        store.retire(0, kv2, cur2, SaveClass.HANDOFF)
        store.flush_saves(0, 5)
        assert kv2.released and store.outcomes.for_request("c")[-2].reason == "tier_unavailable"
        pre3 = store.resolve_prefix_sync(0, "d", list(range(25)))  # more than the device holds: would ask the tier
        assert pre3.device_tokens == 16 and store.outcomes.for_request("d", "resolve")[-1].reason == "tier_unavailable"
        pre3.hold.release()
        assert store.stats()["rank0"]["active_blocks"] == 0


def test_an_unreleased_lease_is_reclaimed_by_the_ttl_reaper_and_counted() -> None:
    with cluster_store(lease_ttl_s=0.2, reap_interval_s=0.05) as (cs, store, model):
        _saved(store, model, "a", list(range(9)))
        tier = store.tier
        assert tier is not None
        keys = RequestKv(store.pools[0], "x", list(range(9)), 0).page_hashes
        hit = store._loop.submit(tier.query("leaky", keys, timeout=5)).result()
        assert hit.pages == 2 and store.stats()["tier"]["open_leases"] == 1
        wait_for(lambda: store.stats()["tier"]["open_leases"] == 0, what="the TTL reclaim")
        counters = cs.cluster.client("host_tier").request(m.Stats(), timeout=5).counters
        assert counters["ttl_reclaimed_leases"] == 1 and counters["index.leases_reclaimed_by_ttl"] == 1
