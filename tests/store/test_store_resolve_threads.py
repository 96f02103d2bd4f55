"""`KvStore.submit_resolve` on the store's resolve threads (`StoreConfig.resolve_threads`), across real processes: a
host hit runs the blocking path on a resolve thread (no hop through the store's loop per call); a resolve that has
to wait continues on the loop and frees its thread, so one waiting resolve never holds up the next; full-hit waits go
to the loop directly; closing the store lets the resolves already taken finish."""

from __future__ import annotations

import time

import pytest

from kvproc.store.types import FULL_HIT, SaveClass, StoreConfig
from kvproc.tiers.host_index import SaveTicket
from tests.conftest import check_bytes, churn, cluster_store, compute, load_reasons, nothing_left, saved

pytestmark = pytest.mark.timeout(60)
ONE_THREAD = StoreConfig(resolve_deadline_s=5.0, resolve_threads=1)


def test_a_host_hit_through_submit_resolve_runs_on_a_resolve_thread_and_restores_the_bytes() -> None:
    with cluster_store(config=ONE_THREAD) as (cs, store, model):
        toks = list(range(17))
        written = saved(store, model, "a", toks)
        model.zero()
        loop_calls = store.counters["resolve_via_loop"]
        pre = store.submit_resolve(0, "b", toks).result(10)
        assert pre.host_tokens == 16
        check_bytes(model, pre, written)
        assert store.counters["resolve_via_loop"] == loop_calls  # never handed to the loop
        assert load_reasons(store, "b") == ["verified"]
        pre.hold.release()
        nothing_left(store)


def test_a_resolve_that_must_wait_continues_on_the_loop_and_frees_its_only_thread() -> None:
    """One resolve thread. Resolve A meets another engine's save in flight (the tier answers Loading): it continues on
    the loop, waiting for the tier's notification, while the same thread serves resolve B at once."""
    with cluster_store(config=ONE_THREAD) as (cs, store, model):
        b_toks = list(range(500, 517))
        written_b = saved(store, model, "b0", b_toks)
        tier = store.tier
        assert tier is not None
        a_hashes = store.pools[0].hasher.hash_prompt(list(range(17)))
        ticket = store._loop.submit(tier.reserve_save("other", a_hashes, [], SaveClass.CACHEABLE, timeout=5)).result()
        assert isinstance(ticket, SaveTicket)
        fut_a = store.submit_resolve(0, "a", list(range(17)))
        churn(store)
        model.zero()
        t0 = time.monotonic()
        pre_b = store.submit_resolve(0, "b", b_toks).result(3)
        assert time.monotonic() - t0 < 2.0 and pre_b.host_tokens == 16  # not stuck behind A
        check_bytes(model, pre_b, written_b)
        pre_b.hold.release()
        assert not fut_a.done() and store.counters["resolve_via_loop"] >= 1
        assert store._loop.submit(tier.commit_save(ticket.save_id, timeout=5)).result()
        pre_a = fut_a.result(5)
        assert pre_a.host_tokens == 16 and store.outcomes.for_request("a", "resolve")[-1].state == "ok"
        pre_a.hold.release()
        nothing_left(store)


def test_a_full_hit_wait_goes_to_the_loop_and_does_not_hold_a_thread() -> None:
    with cluster_store(config=ONE_THREAD) as (cs, store, model):
        toks = list(range(16))
        fut = store.submit_resolve(0, "dec", toks, policy=FULL_HIT)  # waits until the producer's save lands
        time.sleep(0.2)
        assert not fut.done()
        kv, cur, _, _ = compute(store, model, "prod", toks)  # its own resolve runs meanwhile
        store.retire(0, kv, cur, SaveClass.HANDOFF)
        pre = fut.result(5)
        assert pre.hit_tokens == 16
        pre.hold.release()


def test_closing_the_store_lets_the_resolves_already_taken_finish() -> None:
    with cluster_store(config=StoreConfig(resolve_deadline_s=5.0, resolve_threads=2)) as (cs, store, model):
        prompts = [list(range(100 * i, 100 * i + 17)) for i in range(6)]
        for i, toks in enumerate(prompts):
            saved(store, model, f"s{i}", toks)
        futs = [store.submit_resolve(0, f"r{i}", toks) for i, toks in enumerate(prompts)]
        store.close()  # waits for the taken ones; the ones still queued run too (nothing is dropped)
        for f in futs:
            pre = f.result(0)  # every future has its result by now
            assert pre.hit_tokens in (0, 16)
            pre.hold.release()
