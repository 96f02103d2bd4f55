"""The eviction seam (`kvproc.core.eviction`): each policy's order, and the pool's lifecycles under every policy.

The pool's state machine (`test_pool_properties.PoolMachine`: requests, holds, reservations, pins, copy orders against
a model of who holds what) runs again with each non-default policy, plus invariants of the seam itself: a referenced
block is never in the policy (so it can never be a victim), the policy's count equals its stamps, and free + evictable
+ referenced blocks add up to the pool.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import settings
from hypothesis.stateful import invariant

from kvproc import BlockPool
from kvproc.core.eviction import POLICIES, EvictionPolicy, FrequencyRecency, make_policy
from kvproc.core.paged import PagedBlocks
from tests.core.test_pool_properties import PoolMachine
from tests.hypothesis_budget import examples


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.mark.parametrize("name", POLICIES)
def test_every_policy_meets_the_protocol_and_evicts_only_what_it_holds(name):
    p = make_policy(name, 16)
    assert isinstance(p, EvictionPolicy)
    p.insert([3, 4, 5, 6])
    p.remove([4])
    assert len(p) == 3 and 4 not in p and 3 in p
    p.stamp[5] = -1  # an owner's C pass took 5 out
    p.removed(1)
    got = p.pop_oldest(2)
    assert sorted(got) == [3, 6] and len(p) == 0
    with pytest.raises((ValueError, StopIteration, IndexError, KeyError)):
        p.pop_oldest(1)


def test_lfu_evicts_the_least_used_first_and_ties_in_insertion_order():
    p = make_policy("lfu", 8)
    p.bind([0, 1, 2, 3], [bytes([i]) * 16 for i in range(4)])
    p.insert([0, 1, 2, 3])  # one use each
    p.remove([1])
    p.insert([1])  # block 1: two uses
    assert p.pop_oldest(3) == [0, 2, 3]  # the once-used, oldest first; 1 stays
    assert list(p) == [1]


def test_lrfu_decay_lets_a_recent_page_outrank_an_old_frequent_one():
    clock = Clock()
    p = make_policy("lrfu", 8, half_life=10.0, clock=clock)
    p.bind([0, 1], [b"\x01" * 16, b"\x02" * 16])
    for _ in range(3):  # page 0 used 3 times at t=0
        p.remove([0])
        p.insert([0])
    clock.t = 100.0  # ten half-lives later: 3 uses decayed to 3/1024
    p.insert([1])
    assert p.pop_oldest(1) == [0]


def test_lrfu_history_outlives_the_eviction_lfu_per_fill_would_not():
    # Content b"A" was used 3 times, evicted, and comes back in another slot: with history it keeps its count and
    # outranks a page used once since; the count is the key's, not the slot's.
    clock = Clock()
    p = make_policy("lrfu", 8, half_life=math.inf, clock=clock)
    a, b = b"A" * 16, b"B" * 16
    p.bind([0], [a])
    for _ in range(3):
        p.remove([0])
        p.insert([0])
    assert p.pop_oldest(1) == [0]
    p.bind([5, 6], [b, a])
    p.insert([6, 5])  # a (slot 6) inserted first: without history it would go first
    assert p.pop_oldest(1) == [5]


def test_heap_compaction_keeps_only_live_entries():
    p = FrequencyRecency(64, half_life=math.inf, history=False)
    for _ in range(2000):  # each re-insert leaves a stale heap entry behind
        p.insert(np.arange(8))
    assert len(p) == 8 and p._stored <= 4 * 8 + 4096 + 8
    assert sorted(p.pop_oldest(8)) == list(range(8))


@pytest.mark.parametrize("name", POLICIES)
def test_paged_blocks_never_evicts_a_referenced_block(name):
    pb = PagedBlocks(6, name)
    ids = pb.allocate(6)
    pb.register(ids, [bytes([i]) * 16 for i in range(6)])
    pb.release(ids[:4])  # four evictable; ids[4:] still referenced
    pb.acquire(ids[:1])  # one of them re-referenced (a hit)
    got = pb.allocate(3)
    assert sorted(got) == sorted(ids[1:4])  # only the three unreferenced ones could go
    with pytest.raises(RuntimeError):
        pb.allocate(1)


class _EvictionPoolMachine(PoolMachine):
    EVICTION = "lrfu"

    def __init__(self) -> None:
        super().__init__()
        # the same pool, with this policy (nothing touched it yet)
        self.pool = BlockPool(self.SPEC, self.NUM_BLOCKS, bounded_slots=dict(self.BOUNDED_SLOTS),
                              live_slots=self.LIVE_SLOTS, eviction=self.EVICTION)

    @invariant()
    def policy_holds_exactly_the_unreferenced_sealed_blocks(self) -> None:
        paged = self.pool.paged
        pol = paged.inactive
        in_pol = pol.stamp >= 0
        assert len(pol) == int(in_pol.sum())
        assert not (in_pol & (paged.refcount > 0)).any(), "a referenced block is evictable"
        assert (in_pol == ((paged.refcount == 0) & paged.hashed)).all()
        assert len(paged.free) + len(pol) + int((paged.refcount > 0).sum()) == self.NUM_BLOCKS


class LfuPoolMachine(_EvictionPoolMachine):
    EVICTION = "lfu"


class LrfuPoolMachine(_EvictionPoolMachine):
    EVICTION = "lrfu"


TestLfuPoolLifecycles = LfuPoolMachine.TestCase
TestLrfuPoolLifecycles = LrfuPoolMachine.TestCase
for _case in (TestLfuPoolLifecycles, TestLrfuPoolLifecycles):
    _case.settings = settings(max_examples=examples(60), stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("history", [True, False])
@pytest.mark.parametrize("half_life", [2.0, math.inf])
def test_lrfu_evicts_in_the_order_one_heap_of_every_id_would(history, half_life):
    """Runs (one per insert, merged at eviction) pop ids in exactly the (score, insertion) order; `list(p)` sorts
    every live entry at once, an independent path. Random batches, re-inserts, removals, evictions of 1..all; with
    an infinite half-life (LFU) scores tie across runs, so the insertion order decides between runs too."""
    rng = np.random.default_rng(7)
    clock = Clock()
    p = FrequencyRecency(300, half_life=half_life, history=history, clock=clock)
    inside: set[int] = set()
    for _ in range(400):
        clock.t += float(rng.exponential(0.3))
        op = rng.random()
        outside = [i for i in range(300) if i not in inside]
        if op < 0.5 and outside:
            ids = rng.choice(outside, size=int(rng.integers(1, min(len(outside), 60) + 1)), replace=False).tolist()
            if history:  # few distinct contents: equal scores across and within batches
                p.bind(ids, [bytes([int(rng.integers(5))]) * 16 for _ in ids])
            p.insert(ids)
            inside.update(ids)
        elif op < 0.7 and inside:
            ids = rng.choice(sorted(inside), size=int(rng.integers(1, len(inside) + 1)), replace=False).tolist()
            p.remove(ids)
            inside.difference_update(ids)
        elif inside:
            n = int(rng.integers(1, len(inside) + 1))
            want = list(p)[:n]
            assert p.pop_oldest(n) == want
            inside.difference_update(want)
        assert len(p) == len(inside) and set(p) == inside


def test_native_sketch_update_equals_numpy_s():
    """`_sketch.c`'s update gives the cells and estimates numpy's add.at form gives, batches whose fingerprints share
    cells included (a batch's pages see each other's increments)."""
    import kvproc.core.eviction.sketch as sketch
    from kvproc import native

    if native.NATIVE is None:
        pytest.skip("kvproc.native._native not built")
    rng = np.random.default_rng(3)
    a, b = sketch.DecayedSketch(1000, 30.0), sketch.DecayedSketch(1000, 30.0)
    for step in range(60):
        fps = rng.integers(0, 2**64 - 1, size=int(rng.integers(1, 500)), dtype=np.uint64)
        fps[: len(fps) // 3] = fps[0]  # one content many times in the batch
        got = a.add(fps, step * 11.0)
        sketch.NATIVE = None
        try:
            want = b.add(fps, step * 11.0)
        finally:
            sketch.NATIVE = native.NATIVE
        assert np.array_equal(got[0], want[0]) and got[1] == want[1]
    assert np.array_equal(a.cells, b.cells)
