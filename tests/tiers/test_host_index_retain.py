"""The retention hint in the host tier's index (`HostIndex.reserve_save(retain_s=...)`): at the save's commit its
pages enter the eviction policy ranked as if used `retain_s` later (bounded by `max_retain_s`), under lru and lrfu;
a hinted page outlives an un-hinted one of equal history; a hint never makes a leased or hand-off page evictable,
never keeps a page past capacity (a later save still finds room), and None is today's order.

Controls: the "outlives" tests run each case with the hint off too and assert the opposite victim."""

from __future__ import annotations

import pytest

from kvproc.tiers.host_index import Hit, HostIndex, SaveClass, SaveTicket, Shed

POLICIES = ("lru", "lrfu")


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def K(name: str, i: int) -> bytes:
    return f"{name}{i}".encode().ljust(16, b".")


def keys(name: str, n: int) -> list[bytes]:
    return [K(name, i) for i in range(n)]


def save(idx: HostIndex, req: str, ks: list[bytes], retain_s: float | None = None,
         save_class: SaveClass = SaveClass.CACHEABLE) -> SaveTicket | Shed:
    t = idx.reserve_save(req, ks, (), save_class, retain_s=retain_s)
    if isinstance(t, SaveTicket):
        assert idx.commit_save(t.save_id)
    return t


@pytest.mark.parametrize("eviction", POLICIES)
@pytest.mark.parametrize("hint", [True, False])
def test_a_hinted_prompt_outlives_an_unhinted_one_of_equal_history(eviction: str, hint: bool) -> None:
    clock = Clock()
    idx = HostIndex(8, high_watermark=1.0, eviction=eviction, clock=clock)
    save(idx, "a", keys("a", 3), retain_s=600.0 if hint else None)  # saved first: without the hint, evicted first
    clock.t = 1.0
    save(idx, "b", keys("b", 3))
    clock.t = 2.0
    assert isinstance(save(idx, "c", keys("c", 5)), SaveTicket)  # needs 3 slots: one prompt goes
    a_left, b_left = idx.committed_run(keys("a", 3)), idx.committed_run(keys("b", 3))
    assert (a_left, b_left) == ((3, 0) if hint else (0, 3))
    assert idx.stats().get("saves_with_retain_hint", 0) == int(hint)
    assert idx.stats().get("pages_retain_hinted", 0) == (3 if hint else 0)


@pytest.mark.parametrize("eviction", POLICIES)
@pytest.mark.parametrize("hint", [True, False])
def test_a_hinted_save_re_ranks_the_pages_it_finds_present(eviction: str, hint: bool) -> None:
    """A hinted save of a prompt whose head the tier already holds (`KvStore.seal` sends a hinted save from page 0)
    holds the present pages and re-ranks them with the hint at its commit, not only its new pages."""
    clock = Clock()
    idx = HostIndex(10, high_watermark=1.0, eviction=eviction, clock=clock)
    save(idx, "a", keys("a", 3))
    clock.t = 1.0
    save(idx, "b", keys("b", 3))
    clock.t = 2.0
    t = save(idx, "a2", keys("a", 4), retain_s=600.0 if hint else None)  # a's 3 pages present, 1 new
    assert isinstance(t, SaveTicket) and t.page_slots[:3] == (None, None, None)
    clock.t = 3.0
    save(idx, "b2", keys("b", 3))  # b used again: now more recent than a's re-save
    clock.t = 4.0
    assert isinstance(save(idx, "c", keys("c", 6)), SaveTicket)  # 10 slots, 7 held: 3 go
    # with the hint a's four pages stay and b's go; without it b's (used last) stay and a's tail goes
    assert idx.committed_run(keys("a", 4)) == (4 if hint else 1)
    assert idx.committed_run(keys("b", 3)) == (0 if hint else 3)


@pytest.mark.parametrize("eviction", POLICIES)
@pytest.mark.parametrize("hint", [True, False])
def test_a_hinted_save_reaches_pages_another_save_is_still_writing(eviction: str, hint: bool) -> None:
    """The request's last save is still in flight when its hinted save is reserved (at tensor parallel the ranks
    commit it later): its pages are pending, neither copied nor held by the hinted save, and take the hint at their own
    save's commit. Control: the same sequence without the hint loses a's pages first."""
    clock = Clock()
    idx = HostIndex(8, high_watermark=1.0, eviction=eviction, clock=clock)
    last = idx.reserve_save("a", keys("a", 3), ())  # the request's last save, in flight
    assert isinstance(last, SaveTicket)
    hinted = save(idx, "a", keys("a", 3), retain_s=600.0 if hint else None)
    assert isinstance(hinted, SaveTicket) and hinted.page_slots == (None, None, None)
    assert idx.commit_save(last.save_id)  # lands after the hinted save: its pages carry the hint
    clock.t = 1.0
    save(idx, "b", keys("b", 3))
    clock.t = 2.0
    assert isinstance(save(idx, "c", keys("c", 5)), SaveTicket)  # needs 3 slots: one prompt goes
    assert (idx.committed_run(keys("a", 3)), idx.committed_run(keys("b", 3))) == ((3, 0) if hint else (0, 3))
    assert idx.stats().get("saves_hinted_while_pending", 0) == int(hint)


@pytest.mark.parametrize("eviction", POLICIES)
def test_a_hint_never_keeps_a_page_past_capacity(eviction: str) -> None:
    """A tier full of hinted pages still makes room for an un-hinted save: a hint is a priority, never a pin."""
    clock = Clock()
    idx = HostIndex(6, high_watermark=1.0, eviction=eviction, clock=clock)
    save(idx, "a", keys("a", 3), retain_s=3000.0)
    save(idx, "b", keys("b", 3), retain_s=3000.0)
    assert idx.stats()["free_page_slots"] == 0 and idx.stats()["evictable_entries"] == 6
    t = save(idx, "c", keys("c", 4))
    assert isinstance(t, SaveTicket)
    assert idx.committed_run(keys("c", 4)) == 4 and idx.stats()["entries"] == 6


@pytest.mark.parametrize("eviction", POLICIES)
def test_a_hint_never_evicts_a_leased_or_handoff_page(eviction: str) -> None:
    """Un-hinted leased and hand-off pages stay, whatever hinted pages are around: a save that would need them is
    shed; the hinted (evictable) pages are the room."""
    clock = Clock()
    idx = HostIndex(8, high_watermark=1.0, eviction=eviction, clock=clock)
    save(idx, "p", keys("p", 2), save_class=SaveClass.HANDOFF)  # pinned for its consumer
    save(idx, "l", keys("l", 2))
    hit = idx.query("reader", keys("l", 2))
    assert isinstance(hit, Hit) and hit.pages == 2  # leased
    save(idx, "h", keys("h", 4), retain_s=3000.0)
    assert isinstance(idx.reserve_save("x", keys("x", 5), ()), Shed)  # only the 4 hinted slots can be the room
    assert isinstance(save(idx, "y", keys("y", 4)), SaveTicket)  # they are
    assert idx.committed_run(keys("p", 2)) == 2 and idx.committed_run(keys("l", 2)) == 2
    assert idx.committed_run(keys("h", 4)) == 0


def test_a_hint_is_cut_to_max_retain_s() -> None:
    clock = Clock()
    idx = HostIndex(6, high_watermark=1.0, eviction="lru", clock=clock, max_retain_s=10.0)
    save(idx, "a", keys("a", 3), retain_s=1e9)  # counts as 10 s
    clock.t = 20.0
    save(idx, "b", keys("b", 3))  # used after a's (cut) deadline: outranks it
    clock.t = 21.0
    save(idx, "c", keys("c", 3))
    assert idx.committed_run(keys("a", 3)) == 0 and idx.committed_run(keys("b", 3)) == 3
    with pytest.raises(ValueError, match="retain_s"):
        idx.reserve_save("n", keys("n", 1), (), retain_s=float("nan"))
    with pytest.raises(ValueError, match="retain_s"):
        idx.reserve_save("n", keys("n", 1), (), retain_s=-1.0)


@pytest.mark.parametrize("eviction", ("lru", "lfu", "lrfu"))
def test_no_hint_evicts_in_today_s_order(eviction: str) -> None:
    """retain_s=None and retain_s=0 make the same index, victim for victim, as the call without the argument."""
    runs = []
    for kw in ({}, {"retain_s": None}, {"retain_s": 0.0}):
        clock = Clock()
        idx = HostIndex(7, high_watermark=1.0, eviction=eviction, clock=clock)
        for i in range(12):
            clock.t = float(i)
            t = idx.reserve_save(f"r{i}", keys(f"r{i % 5}", 2 + i % 3), (), **kw)  # type: ignore[arg-type]
            if isinstance(t, SaveTicket):
                idx.commit_save(t.save_id)
        runs.append((sorted(idx.entries), idx.counters["evictions"], list(idx.lru)))
    assert runs[0] == runs[1] == runs[2]
