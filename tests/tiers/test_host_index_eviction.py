"""The host tier's index under each eviction policy (`HostIndex(eviction=...)`): the index's state machine
(`test_host_index_properties`: saves, leases, hand-offs, touches, TTLs) again, plus the seam's own invariants --
a leased or hand-off-pinned entry is never evicted, and the policy holds exactly the committed, unreferenced,
unpinned slots."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis.stateful import invariant

from kvproc.tiers.host_index import HostIndex, SaveClass, SaveTicket
from tests.hypothesis_budget import examples
from tests.tiers.test_host_index_properties import SLOTS, HostIndexMachine


class _EvictionMachine(HostIndexMachine):
    EVICTION = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.idx = HostIndex(SLOTS, high_watermark=0.9, lease_ttl_s=10, handoff_ttl_s=20, save_ttl_s=5,
                             clock=self.clock, eviction=self.EVICTION)

    @invariant()
    def referenced_entries_stay(self) -> None:
        idx = self.idx
        for keys in self.leases.values():
            assert all(k in idx.entries for k in keys), "a leased entry was evicted"
        for keys, _exp in idx.handoffs.values():
            assert all(k in idx.entries for k in keys), "a hand-off entry was evicted"

    @invariant()
    def policy_holds_exactly_the_evictable_slots(self) -> None:
        idx = self.idx
        in_pol = idx.lru.stamp >= 0
        assert len(idx.lru) == int(in_pol.sum())
        assert not (in_pol & (idx.refs > 0)).any()
        assert not (in_pol & ~idx.lru_ok).any()
        assert (in_pol == (idx.committed & idx.lru_ok & (idx.refs == 0))).all()


class LruHostMachine(_EvictionMachine):
    EVICTION = "lru"


class LfuHostMachine(_EvictionMachine):
    EVICTION = "lfu"


class LrfuHostMachine(_EvictionMachine):
    EVICTION = "lrfu"


TestLruHostIndex = LruHostMachine.TestCase
TestLfuHostIndex = LfuHostMachine.TestCase
TestLrfuHostIndex = LrfuHostMachine.TestCase
for _case in (TestLruHostIndex, TestLfuHostIndex, TestLrfuHostIndex):
    _case.settings = settings(max_examples=examples(80), stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("eviction", ["lru", "lfu", "lrfu"])
def test_a_full_tier_evicts_the_policys_victim_never_a_leased_entry(eviction):
    idx = HostIndex(4, high_watermark=1.0, eviction=eviction)

    def save(keys: list[bytes]) -> None:
        t = idx.reserve_save("r", keys, (), SaveClass.CACHEABLE)
        assert isinstance(t, SaveTicket)
        assert idx.commit_save(t.save_id)

    a, b, c, d, e = (bytes([i]) * 16 for i in range(5))
    save([a, b])
    save([c, d])
    lease = idx.query("q", [a, b])  # a, b leased: only c, d may go
    save([e])
    assert a in idx.entries and b in idx.entries and e in idx.entries
    assert (c in idx.entries) != (d in idx.entries)  # exactly one of c, d went; its chain's tail first
    assert d not in idx.entries
    idx.release_lease(lease.lease_id)  # type: ignore[union-attr]
