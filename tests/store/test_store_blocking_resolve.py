"""`resolve_prefix_sync`'s blocking path (`store/resolve_blocking.py`) across real processes: a host hit on the calling
thread's own sockets, a load that outlives the deadline (abandoned, reservation and lease kept until the worker
answers), a worker killed mid-load, and the cases it hands to the store's loop."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace

import pytest
import torch

from kvproc.ipc.cancel import new_token
from kvproc.store.types import FULL_HIT, ResolvePolicy, StoreConfig
from tests.conftest import churn, cluster_store, compute, saved, stopped, wait_for

pytestmark = pytest.mark.timeout(60)
PLAIN = StoreConfig(resolve_deadline_s=3.0, speculative_loads=False)


FORMS = {  # the three forms of a host hit
    "verified": StoreConfig(resolve_deadline_s=3.0),  # the default for pages this store saved: no query at all
    "speculative": StoreConfig(resolve_deadline_s=3.0, verified_loads=False),  # the load flies with the query
    "plain": PLAIN,  # the query first
}


@pytest.fixture(params=list(FORMS))
def config(request) -> StoreConfig:  # type: ignore[no-untyped-def]
    """Every case on every form of a host hit."""
    return FORMS[request.param]


@pytest.fixture(params=["speculative", "plain"])
def query_config(request) -> StoreConfig:  # type: ignore[no-untyped-def]
    """The forms that ask the tier (a hung-query case needs a query; a verified load does not make one)."""
    return FORMS[request.param]


def test_a_host_hit_restores_the_bytes_on_the_calling_thread_and_releases_the_lease(config: StoreConfig) -> None:
    with cluster_store(config=config) as (cs, store, model):
        toks = list(range(17))
        written = saved(store, model, "a", toks)
        model.zero()
        pre = store.resolve_prefix_sync(0, "b", toks)
        assert pre.host_tokens == 16 and pre.device_tokens == 0
        for h, b in zip(pre.hold.hashes, pre.hold.block_ids):
            assert torch.equal(model.block(0, b), written[h][0]) and torch.equal(model.block(1, b), written[h][1])
        assert store.counters["resolve_via_loop"] == 0
        kept = store.counters["verified_pages_kept"] + store.counters["speculative_pages_kept"]
        assert kept == (4 if config.speculative_loads else 0)
        assert store.counters["verified_pages_kept"] == (4 if config.verified_loads and config.speculative_loads else 0)
        assert store.outcomes.for_request("b", "resolve")[-1].state == "ok"
        pre.hold.release()
        wait_for(lambda: store.stats()["tier"]["open_leases"] == 0, what="the lease released")
        assert store.stats()["rank0"]["active_blocks"] == 0


@pytest.mark.parametrize("thread", ["with_a_socket", "fresh"])
def test_a_load_past_the_deadline_is_abandoned_and_keeps_its_reservation_until_the_worker_answers(
        thread: str, config: StoreConfig) -> None:
    """`fresh`: the resolving thread has no socket to the worker yet, so its handshake meets the hung worker too."""
    with cluster_store(config=config) as (cs, store, model):
        toks = list(range(17))
        saved(store, model, "a", toks)
        worker = cs.cluster.pid("copy_worker")
        with stopped(worker):
            t0 = time.monotonic()
            policy = ResolvePolicy(deadline_s=0.3)
            if thread == "fresh":
                out: list = []
                t = threading.Thread(target=lambda: out.append(store.resolve_prefix_sync(0, "b", toks, policy=policy)))
                t.start()
                t.join(5)
                pre = out[0]
            else:
                pre = store.resolve_prefix_sync(0, "b", toks, policy=policy)
            took = time.monotonic() - t0
            assert 0.25 < took < 0.9 and pre.hit_tokens == 0
            assert store.outcomes.for_request("b", "resolve")[-1].reason == "deadline_load", (store.outcomes.for_request("b"), dict(store.counters))
            st = store.stats()
            assert st["store"]["loads_abandoned"] == 1 and st["rank0"]["loads_abandoned_in_flight"] == 1
            assert st["rank0"]["active_blocks"] == 4  # the load's destination blocks stay reserved
            pre.hold.release()
        store.flush_loads(0, 5)  # the worker runs again: its reply settles the abandoned load
        assert store.stats()["rank0"]["active_blocks"] == 0
        assert [o.reason for o in store.outcomes.for_request("b") if o.op == "load"] == ["abandoned"]
        wait_for(lambda: store.stats()["tier"]["open_leases"] == 0, what="the lease released")
        pre = store.resolve_prefix_sync(0, "c", toks)  # and the path works again, on a new socket
        assert pre.host_tokens == 16
        pre.hold.release()


def test_a_worker_killed_during_a_blocking_load_degrades_frees_everything_and_service_resumes(
        config: StoreConfig) -> None:
    with cluster_store(config=config) as (cs, store, model):
        toks = list(range(17))
        saved(store, model, "a", toks)
        worker = cs.cluster.pid("copy_worker")
        out: list = []
        with stopped(worker):
            t = threading.Thread(target=lambda: out.append(store.resolve_prefix_sync(0, "b", toks)))
            t.start()
            # the destination blocks are reserved while the query flies and the Load goes out right after its answer
            wait_for(lambda: store.stats()["rank0"]["active_blocks"] == 4, what="the load's reservation")
            time.sleep(0.1)
            os.kill(worker, signal.SIGKILL)
            t.join(5)
        assert out and out[0].hit_tokens == 0
        assert store.outcomes.for_request("b", "resolve")[-1].reason == "load_failed"
        out[0].hold.release()
        assert store.stats()["rank0"]["active_blocks"] == 0 and not store._loads[0]
        wait_for(lambda: store.stats()["tier"]["open_leases"] == 0, what="the lease released")
        cs.cluster.wait_available("copy_worker", timeout=15)
        pre = store.resolve_prefix_sync(0, "c", toks)  # the blocking path attaches the new incarnation itself
        assert pre.host_tokens == 16 and store.copiers[0].attaches == 2  # type: ignore[attr-defined]
        pre.hold.release()


def test_a_resolve_that_must_wait_continues_on_the_loop_and_a_cancel_token_does_not_need_it(
        config: StoreConfig) -> None:
    with cluster_store(config=config) as (cs, store, model):
        toks = list(range(17))
        saved(store, model, "a", toks)
        pre = store.resolve_prefix_sync(0, "tok", toks, cancel=new_token())
        assert pre.host_tokens == 16 and store.counters["resolve_via_loop"] == 0
        pre.hold.release()
        churn(store)
        # a full-hit policy whose last page was never saved: the loop waits for the producer, here until the deadline
        policy = ResolvePolicy(FULL_HIT.reuse, wait_for_full_hit=True, deadline_s=0.3)
        pre = store.resolve_prefix_sync(0, "full", list(range(20)), policy=policy)
        assert pre.hit_tokens == 0 and store.counters["resolve_via_loop"] == 1
        # (the resolve's own outcome: a speculative load it did not use may settle after it, with its own outcome)
        assert store.outcomes.for_request("full", "resolve")[-1].reason.startswith("deadline_")
        pre.hold.release()
        # released by their messages (a loaded machine delays them: CI once took over 5 s), not by the lease TTL
        wait_for(lambda: store.stats()["tier"]["open_leases"] == 0, timeout=60, what="every declined lease released")
        assert store.stats()["tier"].get("leases_reclaimed_by_ttl", 0) == 0
        assert store.stats()["rank0"]["active_blocks"] == 0


def test_a_shorter_hit_trims_the_reservation_made_while_the_query_flew() -> None:
    with cluster_store(config=PLAIN) as (cs, store, model):
        written = saved(store, model, "a", list(range(9)))  # two pages on the host tier
        pre = store.resolve_prefix_sync(0, "b", list(range(9)) + [500 + i for i in range(8)])  # asks for four
        assert pre.host_tokens == 8 and store.counters["resolve_reserved_in_flight"] == 1
        for h, b in zip(pre.hold.hashes, pre.hold.block_ids):
            assert torch.equal(model.block(0, b), written[h][0])
        assert store.stats()["rank0"]["active_blocks"] == 2  # the two held; the other two went back at once
        pre.hold.release()
        assert store.stats()["rank0"]["active_blocks"] == 0


def test_a_miss_returns_the_in_flight_reservation_and_evicts_no_cached_block() -> None:
    with cluster_store(config=PLAIN) as (cs, store, model):
        kv, cur, _, _ = compute(store, model, "cached", [700 + i for i in range(9)])
        kv.release()  # two pages cached on the device only (never sealed to the tier)
        pre = store.resolve_prefix_sync(0, "miss", [900 + i for i in range(17)])
        assert pre.hit_tokens == 0 and store.outcomes.for_request("miss", "resolve")[-1].state == "ok"
        pre.hold.release()
        assert store.stats()["rank0"]["active_blocks"] == 0
        again = store.resolve_prefix_sync(0, "again", [700 + i for i in range(9)])
        assert again.device_tokens == 8  # still cached: the early reservation took free blocks only
        again.hold.release()


def test_cancelling_during_a_hung_load_returns_at_once_and_the_load_still_settles(config: StoreConfig) -> None:
    with cluster_store(config=config) as (cs, store, model):
        toks = list(range(17))
        saved(store, model, "a", toks)
        token = new_token()
        with stopped(cs.cluster.pid("copy_worker")):
            threading.Timer(0.2, token.cancel).start()
            t0 = time.monotonic()
            pre = store.resolve_prefix_sync(0, "b", toks, cancel=token)
            assert time.monotonic() - t0 < 1.0 and pre.hit_tokens == 0  # long before the 3 s deadline
            assert store.outcomes.for_request("b", "resolve")[-1].reason == "cancelled"
            assert store.stats()["rank0"]["loads_abandoned_in_flight"] == 1  # its blocks stay reserved meanwhile
            pre.hold.release()
        store.flush_loads(0, 5)
        assert store.stats()["rank0"]["active_blocks"] == 0
        wait_for(lambda: store.stats()["tier"]["open_leases"] == 0, what="the lease released")


def test_cancelling_during_a_hung_query_returns_at_once_and_leaves_no_lease(query_config: StoreConfig) -> None:
    with cluster_store(config=query_config) as (cs, store, model):
        toks = list(range(17))
        saved(store, model, "a", toks)
        token = new_token()
        with stopped(cs.cluster.pid("host_tier")):
            threading.Timer(0.2, token.cancel).start()
            t0 = time.monotonic()
            pre = store.resolve_prefix_sync(0, "b", toks, cancel=token)
            assert time.monotonic() - t0 < 1.0 and pre.hit_tokens == 0
            assert store.outcomes.for_request("b", "resolve")[-1].reason == "cancelled"
            pre.hold.release()
        # the tier runs again: it sees the Cancel first (no hit) or answers the Query first (a late hit, released)
        wait_for(lambda: store.stats()["tier"]["open_leases"] == 0, what="no lease left")
        assert store.stats()["rank0"]["active_blocks"] == 0


def test_a_query_answered_after_the_deadline_gives_its_hits_lease_back(query_config: StoreConfig) -> None:
    with cluster_store(config=query_config) as (cs, store, model):
        toks = list(range(17))
        saved(store, model, "a", toks)
        with stopped(cs.cluster.pid("host_tier")):
            pre = store.resolve_prefix_sync(0, "b", toks, policy=ResolvePolicy(deadline_s=0.3))
            assert pre.hit_tokens == 0 and store.outcomes.for_request("b", "resolve")[-1].reason == "deadline_query"
            pre.hold.release()
        # the query's own deadline runs a grace past the resolve's: the tier answers it with a Hit, read late
        wait_for(lambda: store.tier.counters["late_hits_released"] == 1, what="the late hit")  # type: ignore[union-attr]
        wait_for(lambda: store.stats()["tier"]["open_leases"] == 0, what="the late hit's lease released")
        assert store.stats()["rank0"]["active_blocks"] == 0


def test_on_the_loop_path_too_a_query_answered_after_the_deadline_gives_its_hits_lease_back(
        query_config: StoreConfig) -> None:
    with cluster_store(config=replace(query_config, resolve_threads=0)) as (cs, store, model):  # the loop's own path
        toks = list(range(17))
        saved(store, model, "a", toks)
        with stopped(cs.cluster.pid("host_tier")):
            pre = store.submit_resolve(0, "b", toks, policy=ResolvePolicy(deadline_s=0.3)).result(5)
            assert pre.hit_tokens == 0 and store.outcomes.for_request("b", "resolve")[-1].reason == "deadline_query"
            pre.hold.release()
        wait_for(lambda: store.tier.counters["late_hits_released"] == 1, what="the late hit")  # type: ignore[union-attr]
        wait_for(lambda: store.stats()["tier"]["open_leases"] == 0, what="the late hit's lease released")
