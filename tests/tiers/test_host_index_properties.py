"""Property (hypothesis state machine): whatever sequence of saves (committed or aborted, cacheable or hand-off),
queries, lease releases, touches, revokes and TTL reaps the host index sees, a hit only ever names slots that hold
the very pages it was asked for (the test keeps a fake arena: each save "writes" its keys into its reserved slots),
with the generations the save was given; no slot is both free and in use; leases are conserved; and after everything
is released, every entry is evictable again."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvproc.tiers.host_index import Hit, HostIndex, Loading, Miss, SaveClass, SaveTicket, Shed
from tests.hypothesis_budget import examples

SLOTS = 12
KEYS = [bytes([i]) * 16 for i in range(24)]
chains = st.integers(0, 20).flatmap(lambda a: st.integers(1, 4).map(lambda n: KEYS[a : a + n]))


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


class HostIndexMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = Clock()
        self.idx = HostIndex(SLOTS, high_watermark=0.9, lease_ttl_s=10, handoff_ttl_s=20, save_ttl_s=5,
                             clock=self.clock)
        self.arena: dict[int, tuple[bytes, int]] = {}  # slot -> (key, generation) its last completed copy wrote
        self.tickets: dict[int, SaveTicket] = {}  # reserved, not yet committed or aborted
        self.leases: dict[int, list[bytes]] = {}  # lease id -> keys it holds
        self.producers: set[str] = set()

    @rule(keys=chains, handoff=st.booleans(), producer=st.sampled_from(["p1", "p2", "p3"]))
    def reserve(self, keys: list[bytes], handoff: bool, producer: str) -> None:
        t = self.idx.reserve_save(producer, keys, (), SaveClass.HANDOFF if handoff else SaveClass.CACHEABLE)
        if isinstance(t, Shed):
            return
        gens = self.idx.slot_gen
        for k, s in zip(keys, t.page_slots):
            if s is not None:
                assert 0 <= s < SLOTS and all(s not in x.page_slots for x in self.tickets.values())
                # the copy worker writes the page (the test's stand-in for the bytes) at the slot's new generation
                self.arena[s] = (k, int(gens[s]))
        self.tickets[t.save_id] = t
        if handoff:
            self.producers.add(producer)

    @precondition(lambda self: self.tickets)
    @rule(data=st.data(), commit=st.booleans())
    def settle(self, data: st.DataObject, commit: bool) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tickets)))
        self.tickets.pop(sid)
        assert (self.idx.commit_save(sid) if commit else self.idx.abort_save(sid)) in (True, False)

    @rule(keys=chains)
    def query(self, keys: list[bytes]) -> None:
        res = self.idx.query("c", keys)
        if isinstance(res, Hit):
            assert 1 <= res.pages <= len(keys) and len(set(res.page_slots)) == res.pages
            for k, s, g in zip(keys, res.page_slots, res.page_gens):
                assert self.arena.get(s) == (k, g), "a hit must name the slot and generation that hold this page"
            self.leases[res.lease_id] = keys[: res.pages]
        else:
            assert isinstance(res, (Miss, Loading))

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), consume=st.booleans())
    def release(self, data: st.DataObject, consume: bool) -> None:
        lid = data.draw(st.sampled_from(sorted(self.leases)))
        del self.leases[lid]
        producer = data.draw(st.sampled_from(sorted(self.producers))) if consume and self.producers else None
        assert self.idx.release_lease(lid, consume_handoff=producer)
        assert not self.idx.release_lease(lid)  # idempotent

    @precondition(lambda self: self.producers)
    @rule(data=st.data())
    def revoke(self, data: st.DataObject) -> None:
        self.idx.revoke_handoff(data.draw(st.sampled_from(sorted(self.producers))))

    @rule(dt=st.sampled_from([1.0, 6.0, 25.0]))
    def time_passes(self, dt: float) -> None:
        self.clock.t += dt
        out = self.idx.reap()
        if out["leases"]:  # reaped leases are gone: forget the ones past their TTL (all older than 10 s)
            open_now = self.idx.stats()["open_leases"]
            while len(self.leases) > open_now:
                self.leases.pop(min(self.leases))
        for sid in [sid for sid in self.tickets if sid not in self.idx.saves]:
            del self.tickets[sid]  # reclaimed by the save TTL: aborted

    @invariant()
    def accounting(self) -> None:
        s = self.idx.stats()
        pending_slots = sum(x is not None for t in self.tickets.values() for x in t.page_slots)
        assert s["free_page_slots"] + s["entries"] + pending_slots == SLOTS, s  # every slot exactly once
        assert s["open_leases"] == len(self.leases)
        assert s["evictable_entries"] <= s["entries"]

    def teardown(self) -> None:
        for lid in list(self.leases):
            self.idx.release_lease(lid)
        for p in list(self.producers):
            self.idx.revoke_handoff(p)
        for sid in list(self.tickets):
            self.idx.abort_save(sid)
        s = self.idx.stats()
        assert s["evictable_entries"] == s["entries"], s  # nothing holds anything: all of it may be evicted
        assert s["free_page_slots"] + s["entries"] == SLOTS


TestHostIndexMachine = HostIndexMachine.TestCase
TestHostIndexMachine.settings = settings(max_examples=examples(150), stateful_step_count=40, deadline=None)
