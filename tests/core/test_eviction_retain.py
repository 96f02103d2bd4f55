"""The retention hint at the eviction seam (`EvictionPolicy.insert(ids, retain_s=R)`): a hinted page ranks as if used
R seconds later, under lru (held by its deadline, then in the recency order) and lrfu (+R / half-life on its queued
priority). It outlives an un-hinted page of equal history, is overtaken by pages used after its deadline (bounded),
is still evicted when nothing else is left (never a pin), and 0 changes nothing.

Controls: each "outlives" test asserts the opposite order without the hint (the hinted page is inserted first, so
it would go first without it)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproc.core.eviction import make_policy
from tests.hypothesis_budget import examples

HINTED = ("lru", "lrfu")


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def _policy(name: str, clock: Clock, n: int = 16):  # type: ignore[no-untyped-def]
    p = make_policy(name, n, half_life=10.0, clock=clock)
    if p.wants_keys:
        p.bind(list(range(n)), [bytes([i + 1]) * 16 for i in range(n)])
    return p


@pytest.mark.parametrize("name", HINTED)
@pytest.mark.parametrize("hint", [True, False])
def test_a_hinted_page_outlives_an_unhinted_one_of_equal_history(name: str, hint: bool) -> None:
    clock = Clock()
    p = _policy(name, clock)
    p.insert([0, 1], retain_s=30.0 if hint else 0.0)  # first in: without the hint, the first out
    p.insert([2, 3])
    assert p.pop_oldest(2) == ([2, 3] if hint else [0, 1])
    assert sorted(p) == ([0, 1] if hint else [2, 3])


@pytest.mark.parametrize("name", HINTED)
def test_a_hint_is_bounded_a_page_used_after_its_deadline_outranks_it(name: str) -> None:
    clock = Clock()
    p = _policy(name, clock)
    p.insert([0], retain_s=30.0)
    clock.t = 20.0
    p.insert([1])  # used before the hinted page's deadline (t=30): goes first
    assert p.pop_oldest(1) == [1]
    clock.t = 40.0
    p.insert([2])  # used after it: the hinted page goes first now
    assert p.pop_oldest(1) == [0]
    assert list(p) == [2]


@pytest.mark.parametrize("name", HINTED)
def test_a_hint_is_never_a_pin_hinted_pages_go_when_nothing_else_is_left(name: str) -> None:
    clock = Clock()
    p = _policy(name, clock)
    p.insert([0, 1], retain_s=1000.0)
    p.insert([2, 3], retain_s=10.0)
    assert len(p) == 4
    # only hinted pages: they still go, the earliest deadline (the smallest boost) first
    assert sorted(p.pop_oldest(2)) == [2, 3]
    assert sorted(p.pop_oldest(2)) == [0, 1] and len(p) == 0


@pytest.mark.parametrize("name", HINTED)
def test_a_hinted_page_taken_out_is_not_evicted_and_comes_back_plain(name: str) -> None:
    clock = Clock()
    p = _policy(name, clock)
    p.insert([0, 1], retain_s=100.0)
    p.remove([0])  # referenced again (a lease): not evictable
    p.stamp[1] = -1  # an owner's C pass took 1 out
    p.removed(1)
    p.insert([5])
    assert p.pop_oldest(1) == [5] and len(p) == 0
    p.insert([0])  # released again without a hint: ranks as a plain use now (its second)
    for _ in range(2):  # 6: two uses as well, the last one after 0's
        p.remove([6])
        p.insert([6])
    assert p.pop_oldest(1) == [0]


ops = st.lists(st.tuples(st.sampled_from(["insert", "remove", "pop", "tick"]),
                         st.lists(st.integers(0, 11), min_size=1, max_size=4, unique=True),
                         st.sampled_from([0.0, 0.0, 5.0, 50.0])), max_size=40)


@pytest.mark.parametrize("name", HINTED)
@settings(max_examples=examples(150), deadline=None)
@given(seq=ops)
def test_with_hints_the_policy_holds_exactly_what_was_inserted_and_pops_each_once(name: str, seq: list) -> None:
    """Whatever the hints: the count equals the live stamps, a pop returns only ids that were in, each once, and every
    id left can be popped (nothing is pinned by a hint)."""
    clock = Clock()
    p = _policy(name, clock, 12)
    inside: set[int] = set()
    for op, ids, retain in seq:
        if op == "insert":
            p.insert(ids, retain_s=retain)
            inside |= set(ids)
        elif op == "remove":
            p.remove(ids)
            inside -= set(ids)
        elif op == "pop" and inside:
            got = p.pop_oldest(min(len(ids), len(inside)))
            assert len(set(got)) == len(got) and set(got) <= inside
            inside -= set(got)
        else:
            clock.t += retain + 1.0
        assert len(p) == len(inside) == int((p.stamp >= 0).sum())
        assert set(np.flatnonzero(p.stamp >= 0).tolist()) == inside
    assert sorted(p.pop_oldest(len(inside))) == sorted(inside)


@pytest.mark.parametrize("name", ("lru", "lfu", "lrfu"))
@settings(max_examples=examples(100), deadline=None)
@given(seq=ops)
def test_no_hint_is_today_s_order(name: str, seq: list) -> None:
    """A policy told retain_s=0 evicts in exactly the order of one never told anything (the call an index without
    hints makes)."""
    c1, c2 = Clock(), Clock()
    plain, zero = _policy(name, c1, 12), _policy(name, c2, 12)
    for op, ids, retain in seq:
        if op == "insert":
            plain.insert(ids)
            zero.insert(ids, retain_s=0.0)
        elif op == "remove":
            plain.remove(ids)
            zero.remove(ids)
        elif op == "pop" and len(plain):
            k = min(len(ids), len(plain))
            assert plain.pop_oldest(k) == zero.pop_oldest(k)
        else:
            c1.t = c2.t = c1.t + retain + 1.0
    assert list(plain) == list(zero)


@pytest.mark.parametrize("name", HINTED)
def test_what_a_hinted_run_keeps_after_a_forced_eviction_stays_hinted(name: str) -> None:
    """With only hinted pages left, one goes; the rest of its run keeps its rank (not moved ahead of pages used
    since). Control: lru promoting the whole run into the recency order evicts 1 before 2."""
    clock = Clock()
    p = _policy(name, clock)
    p.insert([0, 1], retain_s=100.0)
    assert p.pop_oldest(1) == [0]  # nothing else to evict
    p.insert([2])
    assert p.pop_oldest(1) == [2] and list(p) == [1]
