"""Verified loads (`kvproc/tiers/slot_table.py`, `store/resolve.py`, `store/resolve_blocking.py`) across real
processes, on the blocking path and on the store loop's path: a host hit whose every page the store believes it knows
the slot of is loaded without a query and without a lease, and kept only where the tier's slot table confirms the
belief before the copy was ordered and again after it landed.

The point of these tests: a wrong belief never becomes wrong bytes. A belief naming another page's slot, one with a
stale generation, one whose slot was evicted and handed to a later save -- and a save handed the slot *while the copy
runs* (the case the second check exists for) -- each is dropped, the right bytes come from the tier's own answer (or
nothing comes), and nothing (block, lease) is left behind."""

from __future__ import annotations

import os
import signal
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from kvproc.store.types import FULL_HIT, StoreConfig
from kvproc.tiers.layout import SLOT_TABLE_BYTES
from kvproc.tiers.slot_table import GEN
from tests.conftest import (
    LIES,
    check_bytes,
    churn,
    cluster_store,
    compute,
    lie_about_a,
    load_reasons,
    nothing_left,
    resolve_on,
    restores,
    saved,
    stopped,
    wait_for,
)

pytestmark = pytest.mark.timeout(60)
CONFIG = StoreConfig(resolve_deadline_s=3.0, resolve_threads=0)  # speculative and verified loads: the defaults
# "loop": `submit_resolve` on the store's loop (resolve_threads=0); its resolve threads run the blocking path.
both_paths = pytest.mark.parametrize("path", ["blocking", "loop"])
# A tier of exactly 4 page slots for this model (two 256 B arenas): 3 alignment pages of slack, 4 * (512 + table row).
FOUR_SLOTS = 3 * 4096 + 4 * (512 + SLOT_TABLE_BYTES)


@both_paths
def test_a_verified_load_restores_the_bytes_without_a_query_or_a_lease_and_the_tier_sees_the_use(path: str) -> None:
    with cluster_store(config=CONFIG) as (cs, store, model):
        toks = list(range(17))
        written = saved(store, model, "a", toks)
        queries = store.stats()["tier"].get("query_hit", 0) + store.stats()["tier"].get("query_miss", 0)
        assert restores(store, model, "b", toks, written, path) == 4
        assert store.counters["verified_pages_kept"] == 4 and store.counters["verified_pages_dropped"] == 0
        assert load_reasons(store, "b") == ["verified"]
        assert store.outcomes.for_request("b", "resolve")[-1].state == "ok"
        tier = store.stats()["tier"]
        assert tier.get("query_hit", 0) + tier.get("query_miss", 0) == queries  # the tier was not asked
        wait_for(lambda: store.stats()["tier"].get("touched_pages", 0) == 4, what="the tier told of the use")
        nothing_left(store)


def test_a_stopped_tier_does_not_stop_a_verified_load() -> None:
    """No message to the tier is on a verified load's critical path: with the tier frozen, the host hit still comes
    (the touch waits in the tier's socket until it runs again)."""
    with cluster_store(config=CONFIG) as (cs, store, model):
        toks = list(range(17))
        written = saved(store, model, "a", toks)
        churn(store)
        model.zero()
        with stopped(cs.cluster.pid("host_tier")):
            pre = store.resolve_prefix_sync(0, "b", toks)
            assert pre.host_tokens == 16
            check_bytes(model, pre, written)
            pre.hold.release()
        wait_for(lambda: store.stats()["tier"].get("touched_pages", 0) == 4, what="the touch, once the tier runs")
        nothing_left(store)


@both_paths
@pytest.mark.parametrize("lie", LIES)
def test_a_wrong_belief_is_caught_before_any_copy_and_the_tier_answers_instead(lie: str, path: str) -> None:
    """The slot cache claims page A lives where page B does (B's live slots and generations), or names A's own slots
    with old generations: the table disagrees before anything is copied, the tier is asked, A's bytes come from A's
    slots, and the next resolve (the hit taught the right slots) verifies again."""
    with cluster_store(config=CONFIG) as (cs, store, model):
        a, written, truth = lie_about_a(store, model, lie)
        cache = store.slot_caches[0]
        assert restores(store, model, "r", a, written, path) == 4
        assert store.counters["slot_hints_stale"] == 4 and store.counters["verified_pages_kept"] == 0
        assert load_reasons(store, "r") == [""]  # no speculative copy at all: the queried load only
        assert cache.run(list(written)) == truth
        assert restores(store, model, "r2", a, written, path) == 4
        assert store.counters["verified_pages_kept"] == 4 and load_reasons(store, "r2") == ["verified"]
        nothing_left(store)


@both_paths
def test_a_belief_gone_stale_for_the_later_pages_keeps_the_first_and_asks_for_the_rest(path: str) -> None:
    with cluster_store(config=CONFIG) as (cs, store, model):
        toks = list(range(17))
        written = saved(store, model, "a", toks)
        keys = list(written)
        cache = store.slot_caches[0]
        slots, gens = cache.run(keys)
        cache.learn(keys[2:], slots[2:], [g + 1 for g in gens[2:]])
        assert restores(store, model, "b", toks, written, path) == 4
        # the first two went the speculative way (checked, then confirmed by the hit), the rest by the usual load
        assert store.counters["slot_hints_stale"] == 2
        assert store.counters["speculative_pages_kept"] == 2
        assert load_reasons(store, "b") == ["speculative_partial", ""]
        nothing_left(store)


@both_paths
def test_a_slot_evicted_and_handed_to_a_later_save_is_caught_by_its_generation(path: str) -> None:
    with cluster_store(host_bytes=FOUR_SLOTS, config=CONFIG, num_blocks=48) as (cs, store, model):
        assert store.tier.layout.page_slots == 4  # type: ignore[union-attr]
        a = list(range(17))
        written = saved(store, model, "a", a)
        stale = store.slot_caches[0].run(list(written))
        saved(store, model, "c", list(range(10_000, 10_017)))  # evicts A: its four slots go to C
        assert store.stats()["tier"]["evictions"] >= 4
        store.slot_caches[0].learn(list(written), *stale)  # the store still believes A is where it was
        churn(store)
        pre = resolve_on(store, path, "miss", a)
        assert pre.hit_tokens == 0 and store.counters["verified_pages_kept"] == 0
        assert store.counters["slot_hints_stale"] == 4
        pre.hold.release()
        nothing_left(store)


def test_a_save_handed_the_slots_while_the_copy_runs_is_caught_after_the_copy() -> None:
    """The seqlock's second read. A's belief is right when the load is ordered; the copy worker is frozen with the
    Load in its socket; meanwhile C's save evicts A on a 4-slot tier (a verified load holds no lease) and is handed
    A's slots. The worker then runs the Load (reading slots C's save may be writing) and the Save: the generations
    moved, so none of the copy is kept, the tier is asked and (A is gone) the resolve ends with no host tokens."""
    with cluster_store(host_bytes=FOUR_SLOTS, config=CONFIG, num_blocks=48) as (cs, store, model):
        a = list(range(17))
        saved(store, model, "a", a)
        churn(store)
        worker = cs.cluster.pid("copy_worker")
        os.kill(worker, signal.SIGSTOP)
        try:
            fut = store.submit_resolve(0, "r", a)
            wait_for(lambda: store.counters["speculative_loads_started"] >= 1, timeout=0.9, what="the Load sent")
            kv, cur, _, _ = compute(store, model, "c", list(range(10_000, 10_017)))
            store.retire(0, kv, cur)  # C's ReserveSave is answered by the tier; its Save waits for the worker
            wait_for(lambda: store.stats()["tier"].get("evictions", 0) >= 4, timeout=0.9, what="A evicted")
        finally:
            os.kill(worker, signal.SIGCONT)
        pre = fut.result(10)
        assert pre.hit_tokens == 0
        assert store.counters["verified_pages_kept"] == 0 and store.counters["verified_pages_dropped"] == 4
        assert load_reasons(store, "r") == ["verified_unused"]
        pre.hold.release()
        store.flush_saves(0, 10)
        nothing_left(store)


@both_paths
def test_a_generation_moved_during_the_copy_drops_from_that_page_on(path: str) -> None:
    """Same second read, for a part of the prefix: page 2's generation moves while the copy is frozen (written into
    the tier's table here, as a save handed that slot would): pages 0-1 are kept, 2-3 come from the tier's answer
    (the blocking path: `resolve_prefix_sync` on another thread, since this one holds the worker frozen)."""
    with cluster_store(config=CONFIG) as (cs, store, model), ThreadPoolExecutor(1) as caller:
        toks = list(range(17))
        written = saved(store, model, "a", toks)
        slots, _ = store.slot_caches[0].run(list(written))
        churn(store)
        model.zero()
        table = store.tier.slot_table  # type: ignore[union-attr]
        with stopped(cs.cluster.pid("copy_worker")):
            if path == "blocking":
                fut = caller.submit(store.resolve_prefix_sync, 0, "r", toks)
            else:
                fut = store.submit_resolve(0, "r", toks)
            wait_for(lambda: store.counters["speculative_loads_started"] >= 1, timeout=0.9, what="the Load sent")
            table[GEN, slots[2]] += 1
        pre = fut.result(10)
        assert pre.host_tokens == 16
        check_bytes(model, pre, written)
        assert store.counters["verified_pages_kept"] == 2 and store.counters["verified_pages_dropped"] == 2
        assert load_reasons(store, "r") == ["verified_partial", ""]
        pre.hold.release()
        nothing_left(store)


@pytest.mark.parametrize("how", ["full_hit", "handoff"])
def test_a_full_hit_wait_or_a_hand_off_still_asks_the_tier(how: str) -> None:
    """A hand-off's consumption and a full-hit wait are the tier's business: those resolves query (and confirm a
    speculative copy by the hit) even when every page would verify."""
    with cluster_store(config=CONFIG) as (cs, store, model):
        toks = list(range(17))
        written = saved(store, model, "a", toks)
        churn(store)
        model.zero()
        if how == "full_hit":
            policy = FULL_HIT
        else:
            policy = replace(FULL_HIT, wait_for_full_hit=False, consume_handoff_of="nobody")
        pre = store.resolve_prefix_sync(0, "b", toks, policy=policy)
        assert pre.host_tokens == 16
        check_bytes(model, pre, written)
        assert store.counters["verified_pages_kept"] == 0 and store.counters["speculative_pages_kept"] == 4
        pre.hold.release()
        nothing_left(store)
