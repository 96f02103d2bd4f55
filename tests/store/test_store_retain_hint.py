"""The retention hint end to end: `KvStore.retire(..., retain_s=...)` -> `ReserveSave.retain_s` on the wire -> the
host-tier process's `HostIndex` -> its eviction policy (a ClusterStore's own tier process: the real message path).

- A prompt retired with a hint outlives one retired after it without, when the tier has to evict (lru and lrfu);
  control: the same run without the hint evicts the hinted prompt first (it is the older one).
- A hinted retire covers the request's whole prompt, the prefix it hit included (held and re-ranked on the tier, not
  copied); control: an un-hinted retire sends only the pages after the hit.
- The store refuses a hint that is not a duration, and a hint on a hand-off save.
"""

from __future__ import annotations

import pytest

from kvproc import RequestKv
from kvproc.store.kv_store import KvStore
from kvproc.store.types import SaveClass, SealCursor, StoreConfig
from kvproc.tiers.host_index import Hit
from tests.conftest import compute, wait_for

pytestmark = pytest.mark.timeout(120)

PAGE = 4


def _retire(store: KvStore, model, rid: str, toks: list[int], retain_s: float | None = None) -> None:  # type: ignore[no-untyped-def]
    kv, cur, _, _ = compute(store, model, rid, toks)
    store.retire(0, kv, cur, retain_s=retain_s)
    store.flush_saves(0, 10)
    wait_for(lambda: store.stats()["tier"]["open_saves"] == 0, what="the save committed")


def _tier_pages(store: KvStore, toks: list[int]) -> int:
    """How many of the prompt's pages the tier would serve (a query; its lease released)."""
    tier = store.tier
    assert tier is not None
    hashes = RequestKv(store.pools[0], "probe", toks, 0).page_hashes
    res = store._loop.submit(tier.query("probe", hashes, timeout=5)).result()
    if not isinstance(res, Hit):
        return 0
    tier.release_lease(res.lease_id)
    return res.pages


@pytest.mark.parametrize("eviction", ["lru", "lrfu"])
@pytest.mark.parametrize("hint", [True, False])
def test_a_prompt_retired_with_a_hint_outlives_one_retired_after_it_without(eviction: str, hint: bool) -> None:
    from tests.conftest import cluster_store

    # 40 page slots of 512 B (two 256-byte arenas) on the tier: a few prompts fill it
    with cluster_store(40 * 512 + 4096, config=StoreConfig(resolve_deadline_s=3.0, eviction=eviction)) as (
            cs, store, model):
        slots = store.stats()["tier"]["page_slots"]
        a, b = list(range(1, 13)), list(range(101, 113))  # 3 pages each
        _retire(store, model, "a", a, retain_s=600.0 if hint else None)
        _retire(store, model, "b", b)
        st = store.stats()["tier"]
        assert st.get("saves_with_retain_hint", 0) == int(hint) and st.get("pages_retain_hinted", 0) == 3 * hint
        n = 0
        while store.stats()["tier"].get("evictions", 0) == 0:  # distinct 3-page prompts until the tier evicts
            n += 1
            assert n <= slots, "the tier never evicted"
            _retire(store, model, f"f{n}", [1000 * n + i for i in range(12)])
        a_left, b_left = _tier_pages(store, a), _tier_pages(store, b)
        if hint:
            assert a_left == 3 and b_left < 3  # the un-hinted, newer prompt was the room
        else:
            assert a_left < 3  # the control: the older prompt goes first


def test_a_hinted_retire_covers_the_prefix_it_hit() -> None:
    from tests.conftest import cluster_store

    with cluster_store(config=StoreConfig(resolve_deadline_s=3.0)) as (cs, store, model):
        head = list(range(1, 13))  # 3 pages
        _retire(store, model, "a", head)
        before = store.stats()["tier"]
        _retire(store, model, "a2", head + list(range(13, 21)), retain_s=120.0)  # hits 3 pages, computes 2
        after = store.stats()["tier"]
        assert after["saves_with_retain_hint"] == 1
        assert after["pages_retain_hinted"] == 5  # the whole prompt, the 3 pages it hit included
        assert after["save_dedup_pages"] - before.get("save_dedup_pages", 0) == 3  # held, not copied
        assert after["pages_saved"] - before["pages_saved"] == 2
        _retire(store, model, "a3", head + list(range(13, 25)))  # control: no hint, only the pages after the hit
        last = store.stats()["tier"]
        assert last["saves_with_retain_hint"] == 1 and last["save_dedup_pages"] == after["save_dedup_pages"]


def test_the_store_refuses_a_hint_that_is_not_a_duration_or_on_a_handoff() -> None:
    from tests.conftest import cluster_store

    with cluster_store(config=StoreConfig(resolve_deadline_s=3.0)) as (cs, store, model):
        kv, cur, _, _ = compute(store, model, "x", list(range(1, 9)))
        for bad, exc in ((-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
                         ("60", TypeError), (True, TypeError)):
            with pytest.raises(exc, match="retain_s"):
                store.seal(0, kv, cur, retain_s=bad)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="cacheable"):
            store.retire(0, kv, SealCursor.after_prefix(0), SaveClass.HANDOFF, retain_s=60.0)
        assert cur.pages == 0  # nothing was sent
        store.retire(0, kv, cur)


@pytest.mark.parametrize("hint", [True, False])
def test_a_direct_save_carries_the_hint_to_the_tier(hint: bool) -> None:
    """`HostDirect.save(..., retain_s=)`, the path the vLLM connector saves by, sends the hint too."""
    from kvproc.store.host_direct import HostDirect
    from tests.conftest import cluster_store

    with cluster_store(config=StoreConfig(resolve_deadline_s=3.0)) as (cs, store, model):
        hd = HostDirect(store, cs.host_segment)
        try:
            keys = [b"d" + i.to_bytes(4, "little") + bytes(11) for i in range(3)]
            assert hd.save("d", keys, lambda t: None, retain_s=90.0 if hint else None)
            st = store.stats()["tier"]
            assert st.get("saves_with_retain_hint", 0) == int(hint) and st.get("pages_retain_hinted", 0) == 3 * hint
            with pytest.raises(ValueError, match="cacheable"):
                hd.save("h", keys, lambda t: None, save_class=SaveClass.HANDOFF, retain_s=90.0)
        finally:
            hd.close()
