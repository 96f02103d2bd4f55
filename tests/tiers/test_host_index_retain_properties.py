"""Property: the host index's state machine (`test_host_index_properties.HostIndexMachine`: saves committed or aborted,
cacheable or hand-off, queries, lease releases, revokes, TTL reaps, time passing) with retention hints on the saves,
under lru and lrfu. On top of that machine's invariants (a hit names the slots holding its pages, every slot once,
leases conserved, everything evictable once released):
- the eviction policy holds only committed, unreferenced, un-pinned slots, hinted or not (a hint never makes a leased,
  pending or hand-off page a victim);
- a cacheable save is shed for room only when the free and evictable slots, hinted ones included, cannot hold its new
  pages (a hint never keeps a page past capacity)."""

from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule

from kvproc.tiers.host_index import HostIndex, SaveClass, Shed
from tests.hypothesis_budget import examples
from tests.tiers.test_host_index_properties import SLOTS, HostIndexMachine, chains


class RetainMachine(HostIndexMachine):
    EVICTION = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.idx = HostIndex(SLOTS, high_watermark=0.9, lease_ttl_s=10, handoff_ttl_s=20, save_ttl_s=5,
                             clock=self.clock, eviction=self.EVICTION, max_retain_s=30.0)

    @rule(keys=chains, handoff=st.booleans(), producer=st.sampled_from(["p1", "p2", "p3"]),
          retain=st.sampled_from([None, 0.0, 5.0, 50.0]))
    def reserve(self, keys: list[bytes], handoff: bool, producer: str, retain: float | None = None) -> None:
        idx = self.idx
        new = [k for k in dict.fromkeys(keys) if k not in idx.entries and k not in idx.pending]
        present = {idx.entries[k] for k in keys if k in idx.entries}
        room = len(idx.free_pages) + len(idx.lru) - sum(1 for s in present if idx.lru.stamp[s] >= 0)
        if handoff:
            retain = None  # the store refuses a hint on a hand-off (`check_retain_s`)
        t = idx.reserve_save(producer, keys, (), SaveClass.HANDOFF if handoff else SaveClass.CACHEABLE,
                             retain_s=retain)
        if isinstance(t, Shed):
            assert "busy" in t.reason or room < len(new), (t.reason, room, len(new))
            return
        gens = idx.slot_gen
        for k, s in zip(keys, t.page_slots):
            if s is not None:
                assert 0 <= s < SLOTS and all(s not in x.page_slots for x in self.tickets.values())
                self.arena[s] = (k, int(gens[s]))
        self.tickets[t.save_id] = t
        if handoff:
            self.producers.add(producer)

    @invariant()
    def policy_holds_only_unheld_committed_pages(self) -> None:
        idx = self.idx
        inside = np.flatnonzero(idx.lru.stamp >= 0)
        assert len(inside) == len(idx.lru)
        assert idx.committed[inside].all() and idx.lru_ok[inside].all() and not idx.refs[inside].any()
        assert not any(s in idx.owners for s in inside.tolist())


class RetainMachineLrfu(RetainMachine):
    EVICTION = "lrfu"


TestRetainLru = RetainMachine.TestCase
TestRetainLru.settings = settings(max_examples=examples(150), stateful_step_count=40, deadline=None)
TestRetainLrfu = RetainMachineLrfu.TestCase
TestRetainLrfu.settings = settings(max_examples=examples(150), stateful_step_count=40, deadline=None)
