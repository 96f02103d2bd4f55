"""Issue 15 item 9: a hand-off revoke that reaches the host index before the hand-off's commit is remembered (bounded,
until the hand-off TTL), so the later commit pins nothing; pure index, no processes."""

from __future__ import annotations

import time

import pytest

from kvproc.tiers.host_index import Hit, HostIndex, SaveClass, SaveTicket, Shed
from tests.conftest import cluster_store, compute, stopped, wait_for
from tests.tiers.conftest import Clock, K


def reserve(idx: HostIndex, keys: list[bytes], req: str, cls: SaveClass = SaveClass.HANDOFF) -> SaveTicket:
    t = idx.reserve_save(req, keys, (), cls)
    assert isinstance(t, SaveTicket)
    return t


def test_a_revoke_between_reserve_and_commit_leaves_the_commit_unpinned() -> None:
    idx = HostIndex(2, high_watermark=1.0)
    t = reserve(idx, K[:2], "prod")
    assert not idx.revoke_handoff("prod")  # nothing committed yet: nothing to release now
    assert idx.commit_save(t.save_id)
    st = idx.stats()
    assert st["open_handoffs"] == 0 and st["evictable_entries"] == 2 and not idx.owners
    assert st["handoffs_revoked_before_commit"] == 1
    # The tier is full of that hand-off's pages, which must be evictable: another save fits.
    assert isinstance(idx.reserve_save("x", K[5:6]), SaveTicket)


def test_a_revoke_before_the_reserve_is_remembered_too() -> None:
    """The store sends the revoke as soon as the request is cancelled; its save's reserve may reach the tier later."""
    idx = HostIndex(2, high_watermark=1.0)
    idx.revoke_handoff("prod")
    assert idx.stats()["remembered_revokes"] == 1
    assert idx.commit_save(reserve(idx, K[:2], "prod").save_id)
    assert idx.stats()["open_handoffs"] == 0 and idx.stats()["evictable_entries"] == 2


def test_every_save_of_a_revoked_producer_stays_unpinned_not_only_the_first() -> None:
    idx = HostIndex(4, high_watermark=1.0)
    first = reserve(idx, K[:2], "prod")
    second = reserve(idx, K[:4], "prod")
    idx.revoke_handoff("prod")
    assert idx.commit_save(first.save_id) and idx.commit_save(second.save_id)
    st = idx.stats()
    assert st["open_handoffs"] == 0 and st["evictable_entries"] == 4 and st["handoffs_revoked_before_commit"] == 2


def test_a_revoke_after_a_commit_also_covers_the_saves_still_in_flight() -> None:
    idx = HostIndex(4, high_watermark=1.0)
    assert idx.commit_save(reserve(idx, K[:2], "prod").save_id)
    later = reserve(idx, K[:4], "prod")
    assert idx.revoke_handoff("prod")  # releases the committed pins
    assert idx.commit_save(later.save_id)
    assert idx.stats()["open_handoffs"] == 0 and idx.stats()["evictable_entries"] == 4 and not idx.owners


def test_a_consumed_handoff_whose_own_save_commits_late_pins_nothing() -> None:
    """Producer B's save deduplicates against A's committed pages, so B's consumer finds the full hit and consumes B
    before B's (empty) save commits: that commit must not pin A's pages for B until the TTL."""
    idx = HostIndex(2, high_watermark=1.0)
    assert idx.commit_save(reserve(idx, K[:2], "a", SaveClass.CACHEABLE).save_id)
    b = reserve(idx, K[:2], "b")
    assert b.copies == 0
    hit = idx.query("dec", K[:2])
    assert isinstance(hit, Hit)
    assert idx.release_lease(hit.lease_id, consume_handoff="b")
    assert idx.commit_save(b.save_id)
    assert idx.stats()["open_handoffs"] == 0 and idx.stats()["evictable_entries"] == 2


def test_other_producers_still_pin() -> None:
    idx = HostIndex(4, high_watermark=1.0)
    idx.revoke_handoff("gone")
    assert idx.commit_save(reserve(idx, K[:2], "live").save_id)
    st = idx.stats()
    assert st["open_handoffs"] == 1 and st["evictable_entries"] == 0
    assert st.get("handoffs_revoked_before_commit", 0) == 0


def test_remembered_revokes_expire_with_the_handoff_ttl() -> None:
    clock = Clock()
    idx = HostIndex(4, high_watermark=1.0, handoff_ttl_s=5, clock=clock)
    idx.revoke_handoff("p1")
    clock.t = 3
    idx.revoke_handoff("p2")
    clock.t = 5
    out = idx.reap()
    assert out == {"leases": [], "handoffs": [], "saves": []}  # expiry of a remembered revoke is not a reclaim
    assert set(idx.revoked) == {"p2"} and idx.stats()["revokes_expired"] == 1
    clock.t = 8
    idx.reap()
    assert not idx.revoked and idx.stats()["remembered_revokes"] == 0
    # Forgotten: a hand-off of that id pins again (the TTL backstop covers it, as before).
    assert idx.commit_save(reserve(idx, K[:1], "p1").save_id)
    assert idx.stats()["open_handoffs"] == 1


def test_a_repeated_revoke_refreshes_its_expiry_and_keeps_the_order() -> None:
    clock = Clock()
    idx = HostIndex(4, handoff_ttl_s=5, clock=clock)
    idx.revoke_handoff("p1")
    clock.t = 1
    idx.revoke_handoff("p2")
    clock.t = 2
    idx.revoke_handoff("p1")
    assert list(idx.revoked) == ["p2", "p1"]
    clock.t = 6
    idx.reap()
    assert list(idx.revoked) == ["p1"]


def test_the_memory_is_bounded_and_forgets_the_oldest() -> None:
    idx = HostIndex(4, high_watermark=1.0, max_remembered_revokes=3)
    for i in range(5):
        idx.revoke_handoff(f"p{i}")
    st = idx.stats()
    assert st["remembered_revokes"] == 3 and st["revokes_forgotten_full"] == 2
    assert list(idx.revoked) == ["p2", "p3", "p4"]
    assert idx.commit_save(reserve(idx, K[:1], "p4").save_id)  # still remembered: no pin
    assert idx.stats()["open_handoffs"] == 0


def test_a_revoke_of_a_shed_save_leaves_nothing_behind_but_the_bounded_memory() -> None:
    idx = HostIndex(1, high_watermark=1.0)
    assert idx.commit_save(reserve(idx, K[:1], "other").save_id)  # pinned: the only slot
    assert isinstance(idx.reserve_save("prod", K[1:2], (), SaveClass.HANDOFF), Shed)
    assert not idx.revoke_handoff("prod")
    st = idx.stats()
    assert st["open_handoffs"] == 1 and st["open_saves"] == 0 and st["remembered_revokes"] == 1


@pytest.mark.timeout(60)
def test_a_revoke_sent_while_the_copy_is_in_flight_leaves_nothing_pinned_across_processes() -> None:
    """Real host tier and copy worker: the hand-off's copy is held back (worker stopped) while the request is revoked,
    so the tier sees the revoke before the commit. Before the fix the commit pinned the pages until the TTL."""
    with cluster_store() as (cs, store, model):
        kv, cur, _, _ = compute(store, model, "a", list(range(17)))
        with stopped(cs.cluster.pid("copy_worker")):
            store.retire(0, kv, cur, SaveClass.HANDOFF)
            store.revoke_handoff("a")  # the request was cancelled: nobody will read its hand-off
            time.sleep(0.2)  # the revoke reaches the tier (a fire-and-forget message) before the copy can land
        store.flush_saves(0, 10)
        wait_for(lambda: store.stats()["tier"]["open_saves"] == 0, what="the save committed")
        tier = store.stats()["tier"]
        assert tier["saves_committed"] == 1 and tier["open_handoffs"] == 0, tier  # not pinned for the TTL
        assert tier["handoffs_revoked_before_commit"] == 1, tier
        assert tier["evictable_entries"] == tier["entries"] == 4, tier
        assert tier["revokes_of_unknown_handoff"] == 1 and tier["remembered_revokes"] == 1, tier
