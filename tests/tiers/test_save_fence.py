"""The save fence: a save whose slots the tier gave back (TTL, abort) never writes them, and never reports ok.

Before the fence, a slow save outlived the tier's save TTL: the reaper returned its slots, a second save committed
its pages into them, then the first copy landed on top; the second save's readers restored the first save's bytes
while both saves reported ok.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproc.tiers import save_fence
from kvproc.tiers.host_index import HostIndex, SaveTicket
from kvproc.tiers.slot_table import FENCE
from tests.store.conftest import Gate, churn, compute, make_store
from tests.tiers.conftest import Clock, K

torch.manual_seed(0)


def _index(page_slots: int = 4, save_ttl_s: float = 10.0) -> tuple[HostIndex, Clock]:
    clock = Clock()
    return HostIndex(page_slots, {}, save_ttl_s=save_ttl_s, clock=clock), clock


def test_a_reaped_save_cannot_claim_its_fence_and_its_commit_is_refused():
    idx, clock = _index()
    a = idx.reserve_save("a", K[:2])
    assert isinstance(a, SaveTicket) and a.fence >= 0
    clock.t = 11.0
    idx.reap()  # the TTL gives a's slots back
    b = idx.reserve_save("b", K[2:4])
    assert isinstance(b, SaveTicket) and set(b.page_slots) == set(a.page_slots)  # the same slots, someone else's
    row = idx.slot_table[FENCE]
    with pytest.raises(save_fence.FenceRevoked):
        save_fence.claim(row, a.fence, a.fence_token)  # a's late copy writes nothing
    save_fence.claim(row, b.fence, b.fence_token)
    save_fence.release(row, b.fence, b.fence_token)
    assert idx.commit_save(b.save_id)
    assert not idx.commit_save(a.save_id) and idx.counters["commits_refused_reclaimed"] == 1


def test_slots_of_a_save_given_back_mid_write_stay_quarantined_until_the_write_is_over():
    idx, clock = _index(page_slots=2)
    a = idx.reserve_save("a", K[:2])
    assert isinstance(a, SaveTicket)
    row = idx.slot_table[FENCE]
    save_fence.claim(row, a.fence, a.fence_token)  # a copy worker is writing (e.g. stalled by SIGSTOP)
    clock.t = 11.0
    idx.reap()
    assert idx.stats()["quarantined_saves"] == 1 and not idx.free_pages  # not handed to anyone
    assert K[0] not in idx.pending  # but no longer waited for
    assert not isinstance(idx.reserve_save("b", K[2:4]), SaveTicket)  # nothing free: shed, never a's slots
    idx.reap()
    assert idx.stats()["quarantined_saves"] == 1  # still writing: still quarantined
    save_fence.release(row, a.fence, a.fence_token)  # the write is over
    assert not idx.commit_save(a.save_id)  # its commit comes: refused, and the slots go back now
    assert idx.stats()["quarantined_saves"] == 0 and sorted(idx.free_pages) == [0, 1]
    with pytest.raises(save_fence.FenceRevoked):
        save_fence.claim(row, a.fence, a.fence_token)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["reserve", "claim", "release", "reap", "commit", "abort"]),
                          st.integers(0, 7)), max_size=60))
def test_no_slot_is_ever_owned_by_two_writable_saves(ops):
    """Property: at any time, the page slots of saves whose fence a writer could claim (or holds) are disjoint, and
    every slot is in exactly one place (free, a writable save, quarantine or committed)."""
    idx, clock = _index(page_slots=6, save_ttl_s=5.0)
    row = idx.slot_table[FENCE]
    tickets: list[SaveTicket] = []
    held: set[int] = set()
    for op, i in ops:
        t = tickets[i % len(tickets)] if tickets else None
        if op == "reserve":
            got = idx.reserve_save(f"r{len(tickets)}", [bytes([len(tickets), j]) * 8 for j in range(1 + i % 3)])
            if isinstance(got, SaveTicket):
                tickets.append(got)
        elif t is None:
            continue
        elif op == "claim" and t.save_id not in held:
            try:
                save_fence.claim(row, t.fence, t.fence_token)
                held.add(t.save_id)
            except save_fence.FenceRevoked:
                pass
        elif op == "release" and t.save_id in held:
            save_fence.release(row, t.fence, t.fence_token)
            held.discard(t.save_id)
        elif op == "reap":
            clock.t += 6.0
            idx.reap()
        elif op == "commit" and t.save_id not in held:  # the store commits after its copy's reply
            idx.commit_save(t.save_id)
        elif op == "abort":
            idx.abort_save(t.save_id)
        writable = [x for x in tickets if int(row[x.fence]) & ~save_fence.WRITING == x.fence_token]
        owned = [s for x in writable for s in x.page_slots if s is not None]
        assert len(owned) == len(set(owned)), "two writable saves own one slot"
        assert set(owned).isdisjoint(idx.free_pages)
        quarantined = [s for x in idx.quarantine.values() for s in x.page_slots if s is not None]
        committed = list(idx.entries.values())
        placed = sorted(list(idx.free_pages) + [s for x in idx.saves.values() for s in x.page_slots if s is not None]
                        + quarantined + committed)
        assert placed == list(range(6)), "a slot leaked or is in two places"
        for x in tickets:  # a save that holds its fence is never one whose slots went back
            if x.save_id in held:
                assert x.save_id in idx.saves or x.save_id in idx.quarantine


def test_a_slow_save_reaped_by_its_ttl_never_lands_on_the_next_owners_slots():
    """End to end on the store (the real in-process tier and copy executor): save A's copy stalls past the tier's
    TTL, B's save commits into A's old slots, then A's copy is let go. B's readers must get B's bytes, and A's save
    must be recorded failed, not ok."""
    store, model, tier, copier = make_store(num_blocks=32)
    assert tier is not None and copier is not None
    hold = Gate(open_=False)
    inner = copier.save

    async def slow_for_a(order):  # the fault: A's copy stalls (a SIGSTOPped worker, a slow repack hook)
        if order.req_id == "a":
            await hold.passage()
        return await inner(order)

    copier.save = slow_for_a  # type: ignore[method-assign]
    with store:
        kv_a, cur_a, _, _ = compute(store, model, "a", list(range(1, 13)))
        store.seal(0, kv_a, cur_a)
        deadline = time.monotonic() + 10
        while not hold.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        slots_a = next(iter(tier.index.saves.values())).page_slots

        async def reap_later() -> None:  # the TTL passes (on the loop: the index is the loop's)
            clock = tier.index.clock
            tier.index.clock = lambda: clock() + 1e6
            tier.index.reap()
            tier.index.clock = clock

        store._loop.submit(reap_later()).result(5)
        kv_b, cur_b, _, written_b = compute(store, model, "b", list(range(100, 112)))
        store.retire(0, kv_b, cur_b)
        deadline = time.monotonic() + 10
        while store.outcomes.for_request("b", "save") == [] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert store.outcomes.for_request("b", "save")[-1].state == "ok"
        assert set(tier.index.entries[k] for k in kv_b.page_hashes) == set(slots_a)  # B got A's old slots
        hold.ev.set()  # A's copy goes now
        store.flush_saves(0, 10)
        assert store.outcomes.for_request("a", "save")[-1].state == "failed"  # before: "ok"
        store.retire(0, kv_a, cur_a)
        churn(store)
        for a in range(2):
            model._arenas[a][1].tensor.zero_()
        pre = store.resolve_prefix_sync(0, "b2", list(range(100, 113)))
        assert pre.host_tokens == 12
        for h, blk in zip(pre.hold.hashes, pre.hold.block_ids):
            assert torch.equal(model.block(0, blk), written_b[h][0]) and torch.equal(model.block(1, blk), written_b[h][1])
        pre.hold.release()


def test_the_pure_python_compare_and_swap_follows_the_same_protocol(monkeypatch):
    monkeypatch.setattr(save_fence, "NATIVE", None)
    row = np.zeros(4, dtype=np.int64)
    table = save_fence.FenceTable(row)
    index, token = table.issue()  # type: ignore[misc]
    save_fence.claim(row, index, token)
    assert table.revoke(index, token) == save_fence.BUSY
    save_fence.release(row, index, token)
    assert table.revoke(index, token) == save_fence.REVOKED
    assert table.revoke(index, token) == save_fence.GONE
    with pytest.raises(save_fence.FenceRevoked):
        save_fence.claim(row, index, token)


def test_save_ttl_is_derived_from_the_copy_deadline_and_a_shorter_one_is_refused():
    assert save_fence.derived_save_ttl(120.0) > 120.0
    assert save_fence.derived_save_ttl(1.0) > 1.0
    with pytest.raises(ValueError, match="must exceed copy_timeout_s"):
        save_fence.derived_save_ttl(120.0, 60.0)  # the old defaults: TTL 60 s under a 120 s copy deadline
    assert save_fence.derived_save_ttl(120.0, 200.0) == 200.0
