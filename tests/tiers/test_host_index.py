"""The host tier's index: two-phase saves, dedup, leases, LRU with watermark, shedding, hand-off pins, TTL."""

from kvproc.tiers.host_index import Hit, HostIndex, Loading, Miss, SaveClass, SaveTicket, Shed
from tests.tiers.conftest import Clock, K


def saved(idx: HostIndex, keys, cls=SaveClass.CACHEABLE, req="p", bounded=()):
    t = idx.reserve_save(req, keys, bounded, cls)
    assert isinstance(t, SaveTicket)
    assert idx.commit_save(t.save_id)
    return t


def test_a_reader_never_sees_a_partial_save():
    idx = HostIndex(8)
    t = idx.reserve_save("p", K[:3])
    assert isinstance(t, SaveTicket) and t.copies == 3
    res = idx.query("c", K[:3])
    assert isinstance(res, Loading) and res.ready_pages == 0 and res.save_id == t.save_id
    idx.commit_save(t.save_id)
    hit = idx.query("c", K[:3])
    assert isinstance(hit, Hit) and hit.pages == 3 and len(set(hit.page_slots)) == 3


def test_aborted_save_frees_its_slots_and_stays_invisible():
    idx = HostIndex(4)
    settled = []
    idx.on_settled = lambda t, ok: settled.append(ok)
    t = idx.reserve_save("p", K[:4])
    idx.abort_save(t.save_id)
    assert isinstance(idx.query("c", K[:4]), Miss)
    assert idx.stats()["free_page_slots"] == 4 and settled == [False]


def test_saves_already_present_are_deduplicated():
    idx = HostIndex(8)
    saved(idx, K[:3])
    t = idx.reserve_save("q", K[:5])
    assert isinstance(t, SaveTicket)
    assert t.page_slots[:3] == (None, None, None) and all(s is not None for s in t.page_slots[3:])


def test_leased_entries_are_not_evicted_and_release_is_idempotent():
    idx = HostIndex(4, high_watermark=1.0)
    saved(idx, K[:4])
    hit = idx.query("c", K[:4])
    assert isinstance(hit, Hit)
    assert isinstance(idx.reserve_save("p2", K[10:12]), Shed)
    assert idx.stats()["save_shed_cacheable"] == 1
    assert idx.release_lease(hit.lease_id) and not idx.release_lease(hit.lease_id)
    assert isinstance(idx.reserve_save("p2", K[10:12]), SaveTicket)


def test_lru_evicts_the_tail_of_a_chain_first():
    idx = HostIndex(4, high_watermark=1.0)
    saved(idx, K[:4])
    saved(idx, K[10:11])  # needs one slot: the tail K[3] goes
    hit = idx.query("c", K[:4])
    assert isinstance(hit, Hit) and hit.pages == 3


def test_high_watermark_starts_eviction_before_allocation_fails():
    idx = HostIndex(10, high_watermark=0.8)
    saved(idx, K[:8])
    saved(idx, K[20:21])  # free 2 -> needs 1, then keep 2 free: evicts 1
    assert idx.stats()["free_page_slots"] == 2 and idx.stats()["evictions"] == 1


def test_bounded_checkpoint_needs_all_required_artifacts():
    idx = HostIndex(8, {"state": 2})
    saved(idx, K[:2], bounded=["state"])
    saved(idx, K[:4])  # pages 2..3 without a checkpoint
    hit = idx.query("c", K[:4])
    assert isinstance(hit, Hit) and hit.pages == 2 and set(hit.bounded_slots) == {"state"}


def test_handoff_entries_are_pinned_until_consumed():
    idx = HostIndex(2, high_watermark=1.0)
    saved(idx, K[:2], SaveClass.HANDOFF, req="prod")
    assert isinstance(idx.reserve_save("x", K[5:6]), Shed)
    hit = idx.query("dec", K[:2])
    assert isinstance(hit, Hit)
    idx.release_lease(hit.lease_id, consume_handoff="prod")
    assert idx.stats()["handoffs_consumed"] == 1
    assert isinstance(idx.reserve_save("x", K[5:6]), SaveTicket)


def test_handoff_revoke_releases_early():
    idx = HostIndex(2, high_watermark=1.0)
    saved(idx, K[:2], SaveClass.HANDOFF, req="prod")
    assert idx.revoke_handoff("prod") and not idx.revoke_handoff("prod")
    assert idx.stats()["handoffs_revoked"] == 1 and idx.stats()["evictable_entries"] == 2


def test_ttl_reclaims_forgotten_leases_handoffs_and_saves_and_counts_them():
    clock = Clock()
    idx = HostIndex(8, lease_ttl_s=1, handoff_ttl_s=5, save_ttl_s=2, clock=clock)
    saved(idx, K[:2], SaveClass.HANDOFF, req="prod")
    hit = idx.query("dec", K[:2])
    assert isinstance(hit, Hit)
    idx.reserve_save("w", K[8:9])
    clock.t = 1.5
    assert idx.reap()["leases"] == ["dec"]
    clock.t = 6
    out = idx.reap()
    assert out["handoffs"] == ["prod"] and out["saves"] == ["w"]
    st = idx.stats()
    assert st["leases_reclaimed_by_ttl"] == 1 and st["handoffs_reclaimed_by_ttl"] == 1
    assert st["saves_reclaimed_by_ttl"] == 1 and st["open_leases"] == 0 and st["free_page_slots"] == 6


def test_a_save_never_evicts_its_own_deduplicated_pages():
    """A conversation's next turn re-saves its prefix (already present, deduplicated) plus new pages. When the tier is
    full and that prefix is the least recently used, making room for the new pages must not evict the prefix they
    extend (the new pages would be unreachable behind the hole), nor may another save evict it before this one
    commits: the save holds its present pages until it settles."""
    idx = HostIndex(4, high_watermark=1.0)
    saved(idx, K[:2])  # the old turn: the oldest entries
    saved(idx, K[10:12])  # something newer
    t = idx.reserve_save("turn2", K[:3])  # the prefix again + one new page: one slot to free
    assert isinstance(t, SaveTicket) and t.page_slots[:2] == (None, None)
    assert isinstance(idx.reserve_save("other", K[20:22]), Shed)  # the rest is held: nothing of turn2 may go
    idx.commit_save(t.save_id)
    hit = idx.query("c", K[:3])
    assert isinstance(hit, Hit) and hit.pages == 3
    idx.release_lease(hit.lease_id)
    s = idx.stats()
    assert s["evictable_entries"] == s["entries"] == 4 and s["evictions"] == 1  # K[10] went, the prefix stayed


def test_an_aborted_or_reclaimed_save_lets_go_of_its_deduplicated_pages():
    clock = Clock()
    idx = HostIndex(4, high_watermark=1.0, save_ttl_s=5, clock=clock)
    saved(idx, K[:2])
    t = idx.reserve_save("a", K[:3])
    idx.abort_save(t.save_id)
    assert idx.stats()["evictable_entries"] == 2
    t2 = idx.reserve_save("b", K[:3])
    assert isinstance(t2, SaveTicket) and idx.stats()["evictable_entries"] == 0
    clock.t = 10
    assert idx.reap()["saves"] == ["b"]
    assert idx.stats()["evictable_entries"] == 2
