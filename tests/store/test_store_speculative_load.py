"""Speculative loads (`store/resolve_blocking.py`, `store/resolve.py`, `tiers/slot_cache.py`) across real processes,
on the blocking path and on the store loop's path: a host hit whose slots the store knows loads them while the tier is
asked, and keeps only what the tier's hit confirms. The point of
these tests is that a wrong hint never becomes wrong bytes: a hint naming another page's slot, a hint whose slot was
evicted and reused, a hint with a stale generation -- each is dropped and the right bytes come from the tier's own
slots, and nothing (block, lease) is left behind."""

from __future__ import annotations

from dataclasses import replace

import pytest

from kvproc.store.types import StoreConfig
from tests.conftest import (
    LIES,
    churn,
    cluster_store,
    lie_about_a,
    load_reasons,
    nothing_left,
    resolve_on,
    restores,
    saved,
)

pytestmark = pytest.mark.timeout(60)
# The query confirms (the verified form, which needs none: test_store_verified_load.py).
CONFIG = StoreConfig(resolve_deadline_s=3.0, verified_loads=False, resolve_threads=0)
# "loop": `submit_resolve` on the store's loop (resolve_threads=0); its resolve threads run the blocking path.
both_paths = pytest.mark.parametrize("path", ["blocking", "loop"])


@both_paths
def test_a_confirmed_speculation_restores_the_bytes_with_the_query_and_load_overlapped(path: str) -> None:
    with cluster_store(config=CONFIG) as (cs, store, model):
        toks = list(range(17))
        written = saved(store, model, "a", toks)
        assert store.slot_caches[0].run(list(written))[0]  # the save taught the store where its pages went
        assert store.stats()["rank0"]["slot_hints"] == 4 and store.counters_flat()["rank0.slot_hints"] == 4
        assert restores(store, model, "b", toks, written, path) == 4
        assert store.counters["speculative_pages_kept"] == 4 and store.counters["speculative_pages_dropped"] == 0
        assert load_reasons(store, "b") == ["speculative"]
        nothing_left(store)


@both_paths
@pytest.mark.parametrize("lie", LIES)
def test_a_wrong_hint_is_never_trusted(lie: str, path: str) -> None:
    """The slot cache claims page A lives where page B does (whose bytes the speculative copy then reads), or names A's
    own slot with an old generation: the hit disagrees, the copies are dropped, A's bytes come from A's slots."""
    with cluster_store(config=CONFIG) as (cs, store, model):
        a, written, truth = lie_about_a(store, model, lie)
        cache = store.slot_caches[0]
        assert restores(store, model, "r", a, written, path) == 4
        assert store.counters["speculative_pages_kept"] == 0 and store.counters["speculative_pages_dropped"] == 4
        assert cache.run(list(written)) == truth  # the usual load that followed taught the right slots
        assert restores(store, model, "r2", a, written, path) == 4  # and the next resolve speculates right
        assert store.counters["speculative_pages_kept"] == 4
        nothing_left(store)


@both_paths
def test_a_slot_evicted_and_reused_for_another_page_is_caught_by_its_generation(path: str) -> None:
    """A small tier: page A is evicted and its slots are handed to later saves (new generations). The hint still
    names A's old (slot, generation): the resolve of A misses (nothing of A is left) and keeps none of the copies;
    once A is saved again elsewhere, the stale hint is dropped and A's new slots serve it."""
    with cluster_store(host_bytes=16 << 10, config=CONFIG, num_blocks=48) as (cs, store, model):
        page_slots = store.tier.layout.page_slots  # type: ignore[union-attr]
        a = list(range(17))
        written = saved(store, model, "a", a)
        stale = store.slot_caches[0].run(list(written))
        for i in range(page_slots // 4 + 2):  # enough saves to evict A and reuse every slot it had
            saved(store, model, f"fill{i}", list(range(10_000 * (i + 1), 10_000 * (i + 1) + 17)))
        assert store.stats()["tier"]["evictions"] >= 4
        store.slot_caches[0].learn(list(written), *stale)  # the store still believes A is where it was
        churn(store)
        pre = resolve_on(store, path, "miss", a)
        assert pre.hit_tokens == 0 and store.counters["speculative_pages_kept"] == 0
        pre.hold.release()
        nothing_left(store)
        assert load_reasons(store, "miss") == ["speculative_unused"]
        again = saved(store, model, "a2", a)  # A is on the tier again, in whatever slots it got now
        store.slot_caches[0].learn(list(again), *stale)
        assert restores(store, model, "r", a, again, path) == 4
        assert store.counters["speculative_pages_kept"] == 0  # the old pair was dropped even where a slot matched
        nothing_left(store)


@both_paths
def test_a_hint_for_the_first_pages_keeps_them_and_loads_the_rest_the_usual_way(path: str) -> None:
    with cluster_store(config=CONFIG) as (cs, store, model):
        toks = list(range(17))
        written = saved(store, model, "a", toks)
        store.slot_caches[0].forget(list(written)[2:])  # the store knows only the first two pages' slots
        assert restores(store, model, "b", toks, written, path) == 4
        assert store.counters["speculative_pages_kept"] == 2 and store.counters["speculative_pages_dropped"] == 0
        # two load orders: the speculative one, then the rest
        assert load_reasons(store, "b") == ["speculative_partial", ""]
        nothing_left(store)


@both_paths
def test_turned_off_the_query_comes_first_and_nothing_is_speculated(path: str) -> None:
    with cluster_store(config=replace(CONFIG, speculative_loads=False)) as (cs, store, model):
        toks = list(range(17))
        written = saved(store, model, "a", toks)
        assert restores(store, model, "b", toks, written, path) == 4
        assert store.counters["speculative_pages_kept"] == 0
        assert store.counters["resolve_reserved_in_flight"] == (1 if path == "blocking" else 0)
        nothing_left(store)
