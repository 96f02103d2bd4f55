"""The store's contract (resolve / seal / retire), each rule its own test.

These tests are about the store's side of the contract: the tier and the copy path are kvproc's real in-process
implementations (`LocalTier`, `LocalCopier`), some behind a gate that holds a call to simulate a hung peer. The same
verbs across real processes are in `test_cluster_*`.
"""

from __future__ import annotations

import time

import pytest
import torch

from kvproc import RequestKv
from kvproc.ipc.cancel import CancelToken
from kvproc.store.types import FULL_HIT, SaveClass, StoreConfig
from kvproc.tiers.host_index import SaveTicket
from tests.store.conftest import churn, compute, make_store

torch.manual_seed(0)


def test_round_trip_restores_every_group_bit_for_bit():
    store, model, tier, _ = make_store(bounded=True)
    with store:
        toks = list(range(1, 17))
        kv, cur, _, written = compute(store, model, "a", toks)
        (seal,) = kv.seal_by_copy()  # checkpoint the bounded state at the 16-token boundary
        live = kv.live_slots["state"]
        model.slot(0, live)[:] = 7
        model.slot(1, live)[:] = 9
        store.execute_copies(0, [seal])
        store.retire(0, kv, cur)
        store.flush_saves(0)
        churn(store)
        for a in range(2):
            model._arenas[a][1].tensor.zero_()
            model._arenas[2 + a][1].tensor.zero_()
        pre = store.resolve_prefix_sync(0, "b", toks + [1])
        assert pre.host_tokens == 16 and pre.device_tokens == 0
        for i, b in enumerate(pre.hold.block_ids):
            exp = written[pre.hold.hashes[i]]
            assert torch.equal(model.block(0, b), exp[0]) and torch.equal(model.block(1, b), exp[1])
        kv2 = RequestKv(store.pools[0], "b", toks + [1], 1)
        assert kv2.try_admit(pre.hold.num_blocks)
        orders = kv2.match_and_add_prefix(pre.hold)
        store.execute_copies(0, orders)
        live2 = kv2.live_slots["state"]
        assert (model.slot(0, live2) == 7).all() and (model.slot(1, live2) == 9).all()
        kv2.release()


def test_resolve_without_a_tier_returns_the_device_hit_with_a_hold_that_survives_eviction():
    store, model, _, _ = make_store(tier=False)
    with store:
        kv, cur, _, _ = compute(store, model, "a", list(range(9)))
        store.retire(0, kv, cur)
        pre = store.resolve_prefix_sync(0, "b", list(range(9)))
        assert pre.device_tokens == 8 and pre.host_tokens == 0
        churn(store)
        store.pools[0].check_hold(pre.hold)
        assert store.pools[0].probe(pre.hold.hashes, 9).num_blocks == 2


def test_a_host_hit_extends_a_device_hit():
    store, model, _, _ = make_store(num_blocks=16)
    with store:
        kv, cur, _, _ = compute(store, model, "a", list(range(33)))
        store.retire(0, kv, cur)
        store.flush_saves(0)
        # evict the tail of the chain on the device only: the head stays, the rest comes from the host
        pool = store.pools[0]
        with pool.lock:
            ids = pool.paged.allocate(len(pool.paged.free) + 5)
            pool.paged.release(ids)
        pre = store.resolve_prefix_sync(0, "b", list(range(33)))
        assert pre.device_tokens == 12 and pre.host_tokens == 20


def test_loading_is_waited_through_until_ready():
    store, model, tier, copier = make_store()
    with store:
        hashes = RequestKv(store.pools[0], "x", list(range(17)), 0).page_hashes
        # another engine's save of this prefix is in flight on the shared tier
        ticket = store._loop.submit(tier.reserve_save("other", hashes, [], SaveClass.CACHEABLE, timeout=1)).result()
        assert isinstance(ticket, SaveTicket)
        fut = store.submit_resolve(0, "b", list(range(17)))
        time.sleep(0.1)
        assert not fut.done()  # the tier answered Loading; the store waits for its notification
        assert store._loop.submit(tier.commit_save(ticket.save_id, timeout=5)).result()
        pre = fut.result(5)
        assert pre.host_tokens == 16


def test_a_tier_that_stays_loading_degrades_at_the_deadline_to_the_device_hit():
    store, model, tier, copier = make_store(config=StoreConfig(resolve_deadline_s=0.3))
    with store:
        kv, cur, _, _ = compute(store, model, "a", list(range(9)))
        store.retire(0, kv, cur)
        store.flush_saves(0)
        copier.save_gate.ev.clear()
        kv2, cur2, _, _ = compute(store, model, "b", list(range(17)))
        store.retire(0, kv2, cur2)
        churn(store)
        pre0 = store.pools[0].probe(kv2.page_hashes, 17)
        pre0.release()
        t0 = time.monotonic()
        pre = store.resolve_prefix_sync(0, "c", list(range(17)))
        assert time.monotonic() - t0 < 1.5
        assert pre.host_tokens == 0
        assert store.stats()["store"]["resolve_degraded_deadline_loading"] == 1
        copier.save_gate.ev.set()
        store.flush_saves(0)


def test_pool_pressure_is_waited_out_and_completes_when_it_clears():
    store, model, tier, _ = make_store(num_blocks=8)
    with store:
        kv, cur, _, _ = compute(store, model, "a", list(range(17)))
        store.retire(0, kv, cur)
        store.flush_saves(0)
        churn(store)
        hog = RequestKv(store.pools[0], "hog", [99] * 28, 0)  # entitled to 7 of 8 blocks
        assert hog.try_admit()
        fut = store.submit_resolve(0, "b", list(range(17)))
        time.sleep(0.15)
        assert not fut.done()
        hog.release()
        pre = fut.result(5)
        assert pre.host_tokens == 16 and store.stats()["store"]["resolve_waited_for_pool"] >= 1


def test_pool_pressure_degrades_at_the_deadline_with_the_lease_released_each_round():
    store, model, tier, _ = make_store(num_blocks=8, config=StoreConfig(resolve_deadline_s=0.3))
    with store:
        kv, cur, _, _ = compute(store, model, "a", list(range(17)))
        store.retire(0, kv, cur)
        store.flush_saves(0)
        churn(store)
        hog = RequestKv(store.pools[0], "hog", [99] * 28, 0)
        assert hog.try_admit()
        pre = store.resolve_prefix_sync(0, "b", list(range(17)))
        assert pre.hit_tokens == 0
        assert store.stats()["store"]["resolve_degraded_deadline_pool_pressure"] == 1
        assert tier.index.stats()["open_leases"] == 0
        hog.release()


def test_full_hit_mode_waits_through_misses_until_the_producers_save_lands():
    store, model, tier, _ = make_store()
    with store:
        toks = list(range(16))
        fut = store.submit_resolve(0, "dec", toks, policy=FULL_HIT)
        time.sleep(0.1)
        assert not fut.done()
        kv, cur, _, _ = compute(store, model, "prod", toks)
        store.retire(0, kv, cur, SaveClass.HANDOFF)
        pre = fut.result(5)
        assert pre.hit_tokens == 16


def test_an_already_cancelled_resolve_does_no_io():
    store, model, tier, _ = make_store()
    with store:
        tok = CancelToken()
        tok.cancel()
        pre = store.resolve_prefix_sync(0, "a", list(range(17)), cancel=tok)
        assert pre.hit_tokens == 0 and tier.query_gate.calls == 0
        assert store.outcomes.for_request("a", "resolve")[-1].reason == "cancelled"
        assert pre.page_hashes is None  # nothing was hashed either


def test_a_resolve_hands_back_its_prompt_hashes_and_a_request_built_on_them_is_the_same():
    """`KvPrefix.page_hashes`: the chain the resolve computed, for `RequestKv(prompt_hashes=...)` to reuse (the
    reference engine does): the same hashes a request computes itself, on every path (device hit, host hit)."""
    store, model, tier, _ = make_store()
    with store:
        toks = list(range(37))
        kv, cur, _, _ = compute(store, model, "a", toks)
        own = list(kv.page_hashes)
        store.retire(0, kv, cur)
        store.flush_saves(0)
        for label in ("device", "host"):
            if label == "host":
                churn(store)
            pre = store.resolve_prefix_sync(0, f"b-{label}", toks)
            assert pre.hit_tokens == 36 and pre.page_hashes == own
            again = RequestKv(store.pools[0], f"c-{label}", toks, 4, prompt_hashes=pre.page_hashes)
            assert again.page_hashes == own
            pre.hold.release()
            again.release()


def test_cancellation_after_the_query_releases_the_lease():
    store, model, tier, copier = make_store()
    with store:
        kv, cur, _, _ = compute(store, model, "a", list(range(17)))
        store.retire(0, kv, cur)
        store.flush_saves(0)
        churn(store)
        copier.load_gate.ev.clear()
        tok = CancelToken()
        fut = store.submit_resolve(0, "b", list(range(17)), cancel=tok)
        time.sleep(0.1)
        tok.cancel()
        pre = fut.result(5)
        assert pre.hit_tokens == 0
        copier.load_gate.ev.set()
        store.flush_loads(0, 5)
        assert tier.index.stats()["open_leases"] == 0


def test_a_hung_query_degrades_by_the_deadline():
    store, model, tier, _ = make_store(config=StoreConfig(resolve_deadline_s=0.3))
    with store:
        kv, cur, _, _ = compute(store, model, "a", list(range(9)))
        store.retire(0, kv, cur)
        tier.query_gate.ev.clear()
        t0 = time.monotonic()
        pre = store.resolve_prefix_sync(0, "b", list(range(17)))
        assert time.monotonic() - t0 < 1.5 and pre.device_tokens == 8 and pre.host_tokens == 0
        tier.query_gate.ev.set()


def test_a_hung_load_degrades_keeps_its_reservation_and_flush_loads_drains_it():
    store, model, tier, copier = make_store(config=StoreConfig(resolve_deadline_s=0.3))
    with store:
        kv, cur, _, _ = compute(store, model, "a", list(range(17)))
        store.retire(0, kv, cur)
        store.flush_saves(0)
        churn(store)
        copier.load_gate.ev.clear()
        pre = store.resolve_prefix_sync(0, "b", list(range(17)))
        assert pre.hit_tokens == 0
        st = store.stats()
        assert st["store"]["loads_abandoned"] == 1 and st["rank0"]["loads_abandoned_in_flight"] == 1
        assert st["rank0"]["active_blocks"] == 4  # the reservation the copy may still write
        copier.load_gate.ev.set()
        store.flush_loads(0, 5)
        st = store.stats()
        assert st["rank0"]["active_blocks"] == 0 and st["tier"]["open_leases"] == 0


def test_seal_pins_blocks_until_the_save_lands():
    store, model, tier, copier = make_store()
    with store:
        copier.save_gate.ev.clear()
        kv, cur, _, _ = compute(store, model, "a", list(range(17)))
        store.seal(0, kv, cur)
        time.sleep(0.05)
        assert store.pinned_blocks(0) == 4
        copier.save_gate.ev.set()
        store.flush_saves(0)
        assert store.pinned_blocks(0) == 0 and cur.pages == 4
        kv.release()


def test_retire_with_cacheable_releases_into_the_prefix_cache_at_once():
    store, model, tier, copier = make_store()
    with store:
        copier.save_gate.ev.clear()
        kv, cur, _, _ = compute(store, model, "a", list(range(17)))
        store.retire(0, kv, cur)
        assert kv.released and store.parked(0) == []
        pre = store.resolve_prefix_sync(0, "b", list(range(17)))
        assert pre.device_tokens == 16
        copier.save_gate.ev.set()


def test_retire_with_handoff_parks_the_kv_until_saves_settle():
    store, model, tier, copier = make_store()
    with store:
        copier.save_gate.ev.clear()
        kv, cur, _, _ = compute(store, model, "a", list(range(17)))
        store.retire(0, kv, cur, SaveClass.HANDOFF)
        assert not kv.released and store.parked(0) == ["a"]
        copier.save_gate.ev.set()
        store.flush_saves(0)
        assert kv.released and store.parked(0) == []


def test_cacheable_saves_shed_under_pin_pressure_and_retry_later():
    store, model, tier, copier = make_store(num_blocks=32, config=StoreConfig(cacheable_pin_fraction=0.25))
    with store:
        copier.save_gate.ev.clear()
        a, ca, _, _ = compute(store, model, "a", list(range(25)))  # 6 pages pinned of a budget of 8
        store.seal(0, a, ca)
        b, cb, _, _ = compute(store, model, "b", [50 + i for i in range(25)])
        store.seal(0, b, cb)  # 6 more would exceed 8: shed, cursor stays
        assert cb.pages == 0 and store.stats()["store"]["save_shed_pin_pressure"] == 1
        copier.save_gate.ev.set()
        store.flush_saves(0)
        store.seal(0, b, cb)  # retried later
        store.flush_saves(0)
        assert cb.pages == 6
        a.release(), b.release()


def test_a_failed_handoff_save_is_counted_and_still_releases():
    store, model, tier, copier = make_store()
    with store:
        copier.fail_saves = True
        kv, cur, _, _ = compute(store, model, "a", list(range(17)))
        store.retire(0, kv, cur, SaveClass.HANDOFF)
        store.flush_saves(0)
        assert kv.released and store.stats()["store"]["handoff_save_failed"] == 1
        assert store.pinned_blocks(0) == 0 and tier.index.stats()["open_saves"] == 0


def test_handoff_pins_do_not_consume_the_cacheable_budget():
    store, model, tier, copier = make_store(num_blocks=32, config=StoreConfig(cacheable_pin_fraction=0.25))
    with store:
        copier.save_gate.ev.clear()
        h, ch, _, _ = compute(store, model, "h", list(range(25)))
        store.seal(0, h, ch, SaveClass.HANDOFF)
        c, cc, _, _ = compute(store, model, "c", [70 + i for i in range(25)])
        store.seal(0, c, cc)
        assert cc.pages == 6  # not shed: the hand-off's 6 pinned pages do not count
        copier.save_gate.ev.set()
        store.flush_saves(0)
        h.release(), c.release()


def test_seal_skips_prefix_hit_blocks():
    store, model, tier, _ = make_store()
    with store:
        kv, cur, _, _ = compute(store, model, "a", list(range(17)))
        store.retire(0, kv, cur)
        store.flush_saves(0)
        kv2, cur2, pre, _ = compute(store, model, "b", list(range(25)))
        assert pre.device_tokens == 16 and cur2.pages == 4
        store.retire(0, kv2, cur2)
        store.flush_saves(0)
        st = tier.index.stats()
        assert st["pages_saved"] == 6 and st["save_dedup_pages"] == 0


def test_the_miss_breaker_counts_only_cold_misses_and_skips_the_tier_while_open():
    store, model, tier, _ = make_store(config=StoreConfig(breaker_misses=2, breaker_cooldown_s=60))
    with store:
        kv, cur, _, _ = compute(store, model, "a", list(range(9)))  # cold miss number 1
        store.retire(0, kv, cur)
        for i in range(3):  # device hits whose new tokens miss on the tier: warm misses, not counted
            store.resolve_prefix_sync(0, f"w{i}", list(range(8)) + [100 + i] * 8).hold.release()
        assert store.stats()["store"].get("breaker_opened", 0) == 0
        store.resolve_prefix_sync(0, "c", [200] * 17).hold.release()  # cold miss number 2: the breaker opens
        assert store.stats()["store"]["breaker_opened"] == 1
        calls = tier.query_gate.calls
        store.resolve_prefix_sync(0, "skipped", [300] * 17).hold.release()
        assert tier.query_gate.calls == calls and store.stats()["store"]["breaker_skips"] == 1


def test_two_resolves_that_each_hold_what_the_other_needs_do_not_wait_for_each_other():
    """Each resolve holds its device prefix (3 of the pool's 6 blocks) and needs 2 more blocks for its host hit.
    Waiting for capacity would keep each hold's blocks from the other until the deadline (the 2-rank demo at half the
    working set stalled 15 s a turn that way); a resolve that holds blocks ends at once with its device hit instead,
    `degraded(pool_pressure)`, leases released. Control: with the wait, both are still waiting 10 s later."""
    store, model, tier, _ = make_store(num_blocks=6, config=StoreConfig(resolve_deadline_s=60.0))
    assert tier is not None
    X, Y = list(range(1, 21)), list(range(101, 121))  # 5 pages each (PAGE 4)
    with store:
        for rid, toks in (("x", X), ("y", Y)):
            kv, cur, _, _ = compute(store, model, rid, toks)
            store.retire(0, kv, cur)
            store.flush_saves(0)
        churn(store)
        for rid, toks in (("x3", X[:13]), ("y3", Y[:13])):  # 3 pages of each back on the device, nothing else
            pre = store.resolve_prefix_sync(0, rid, toks)
            assert pre.host_tokens == 12
            pre.hold.release()
        assert store.pools[0].stats()["inactive_blocks"] == 6
        tier.query_gate.ev.clear()  # both probe (and hold) before either asks the tier
        futs = [store.submit_resolve(0, rid, toks + [0]) for rid, toks in (("x5", X), ("y5", Y))]
        deadline = time.monotonic() + 30
        while tier.query_gate.calls < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        tier.query_gate.ev.set()
        pres = [f.result(10) for f in futs]
        assert [(p.device_tokens, p.host_tokens) for p in pres] == [(12, 0), (12, 0)]
        assert store.stats()["outcomes"]["resolve.degraded.pool_pressure"] == 2
        assert tier.index.stats()["open_leases"] == 0
        for p in pres:
            p.hold.release()


def test_a_resolve_does_not_wait_for_blocks_only_holds_keep():
    """A resolve that holds nothing but cannot reserve its host hit waits for capacity only while something in the
    pool frees blocks by itself (an admitted request, a save's pin). Here every block is held by another resolve's
    hold, and nothing is admitted: in the 2-rank demo that was rank 0 waiting for blocks a finished rank-0 resolve of
    another request held, whose rank-1 twin waited for this request's rank-1 hold (15 s stalls, seed 5). It ends at
    once, `degraded(pool_pressure)`, its lease released. Control: with the wait, it is still waiting 10 s later."""
    store, model, tier, _ = make_store(num_blocks=8, config=StoreConfig(resolve_deadline_s=60.0))
    assert tier is not None
    X, Y = list(range(1, 22)), list(range(101, 126))  # 5 and 6 pages (PAGE 4), each with one token more
    with store:
        for rid, toks in (("x", X), ("y", Y)):
            kv, cur, _, _ = compute(store, model, rid, toks)
            store.retire(0, kv, cur)
            store.flush_saves(0)
        churn(store)
        y = store.resolve_prefix_sync(0, "y6", Y)  # Y's 6 pages restored and held: 2 blocks left, X needs 5
        assert y.host_tokens == 24 and store.pools[0].stats()["active_blocks"] == 6
        assert not store.pools[0].frees_blocks_by_itself()
        pre = store.submit_resolve(0, "x5", X).result(10)
        assert (pre.device_tokens, pre.host_tokens) == (0, 0)
        assert store.outcomes.for_request("x5", "resolve")[-1].reason == "pool_pressure"
        assert tier.index.stats()["open_leases"] == 0
        pre.hold.release()
        y.hold.release()


def test_resolve_prefix_sync_on_the_stores_own_loop_is_refused_not_a_hang():
    """It waits for a resolve that runs on the store's loop: called there, it would wait for itself forever.
    Control: without the check, the call below never returns (the future's wait times out)."""
    store, _, _, _ = make_store()
    with store:
        fut = store._loop.submit(_sync_resolve_on_loop(store))
        with pytest.raises(RuntimeError, match="wait for itself"):
            fut.result(10)


async def _sync_resolve_on_loop(store):
    return store.resolve_prefix_sync(0, "on-loop", list(range(9)))
