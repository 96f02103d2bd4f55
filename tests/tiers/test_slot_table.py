"""The host tier's slot table (`kvproc/tiers/slot_table.py`): what the index writes into it, the check a store runs on
it, and the property verified loads rest on -- a belief the table confirms before a copy and again after it names a
page whose complete, committed bytes the copy read, whatever the belief was and whatever the tier did meanwhile."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvproc.contract import GroupKind, GroupSpec, KvArena, KvSpec, validate_layout
from kvproc.native import NATIVE
from kvproc.runtime.loopthread import LoopThread
from kvproc.tiers.host_index import Hit, HostIndex, Shed
from kvproc.tiers.layout import ALIGN, HostLayout
from kvproc.tiers.slot_table import GEN, TAG, key_tags, verified_run
from kvproc.tiers.touch_batch import TouchBatch
from tests.hypothesis_budget import examples


def test_key_tags_are_the_first_eight_bytes_little_endian() -> None:
    keys = [os.urandom(16) for _ in range(5)] + [b"\x01\x02"]
    want = [int.from_bytes(k[:8].ljust(8, b"\0"), "little", signed=True) for k in keys]
    assert key_tags(keys).tolist() == want
    assert key_tags(keys[:5]).tolist() == want[:5]  # the one-digest-size fast path
    assert key_tags([]).tolist() == []


@pytest.mark.skipif(NATIVE is None, reason="the compiled helpers are not built")
@settings(max_examples=examples(200), deadline=None)
@given(data=st.data(), n=st.integers(0, 40), size=st.integers(4, 64))
def test_the_compiled_check_agrees_with_the_numpy_one(data: st.DataObject, n: int, size: int) -> None:
    table = np.zeros((2, size), dtype=np.int64)
    table[GEN] = data.draw(st.lists(st.integers(0, 3), min_size=size, max_size=size))
    keys = [bytes([data.draw(st.integers(0, 3))]) * 16 for _ in range(n)]
    table[TAG] = data.draw(st.lists(st.sampled_from(key_tags([bytes([i]) * 16 for i in range(4)]).tolist()),
                                    min_size=size, max_size=size))
    slots = data.draw(st.lists(st.integers(-2, size + 2), min_size=n, max_size=n))
    gens = data.draw(st.lists(st.integers(0, 3), min_size=n, max_size=n))
    compiled = verified_run(table, slots, gens, keys)  # lists: the C pass
    numpy_form = verified_run(table, tuple(slots), tuple(gens), tuple(keys))  # tuples: the numpy form
    assert compiled == numpy_form
    tag = {k: int(key_tags([k])[0]) for k in keys}
    assert compiled == next((i for i, (s, g, k) in enumerate(zip(slots, gens, keys))
                             if not (0 <= s < size and table[GEN, s] == g and table[TAG, s] == tag[k] != 0)), n)


@settings(max_examples=examples(200), deadline=None)
@given(data=st.data(), n=st.integers(0, 30), size=st.integers(4, 40))
def test_the_cache_lookup_and_check_in_one_pass_agrees_with_the_two_steps(data: st.DataObject, n: int,
                                                                          size: int) -> None:
    """`SlotCache.run_verified` (one C pass where built, else the two steps) gives what `run` then `verified_run`
    give: the confirmed leading run, and how far the cache's knowledge reaches past it (the stale beliefs)."""
    from kvproc.tiers.slot_cache import SlotCache

    table = np.zeros((2, size), dtype=np.int64)
    table[GEN] = data.draw(st.lists(st.integers(0, 3), min_size=size, max_size=size))
    tags = [bytes([i]) * 8 for i in range(1, 6)] + [bytes(8)]  # a key whose first 8 bytes are 0 never verifies
    table[TAG] = data.draw(st.lists(st.sampled_from(key_tags([t + bytes(8) for t in tags]).tolist()), min_size=size,
                                    max_size=size))
    cache = SlotCache(64)
    keys = [data.draw(st.sampled_from(tags)) + i.to_bytes(8, "little") for i in range(n)]  # 16 bytes, distinct
    for k in keys:
        if data.draw(st.integers(0, 9)):  # most keys known, some not: the run stops at the first unknown one
            cache.learn([k], [data.draw(st.integers(0, size + 1))], [data.draw(st.integers(0, 3))])
    slots, gens, known = cache.run_verified(keys, table)
    run_slots, run_gens = cache.run(keys)
    ok = verified_run(table, tuple(run_slots), tuple(run_gens), tuple(keys))  # the numpy form
    assert (slots, gens, known) == (run_slots[:ok], run_gens[:ok], len(run_slots))



@settings(max_examples=examples(50), deadline=None)
@given(host_bytes=st.integers(8 * 4096, 1 << 22), units=st.lists(st.sampled_from([64, 256, 2048, 5000]), min_size=1,
                                                                      max_size=3))
def test_the_layout_keeps_the_table_inside_the_budget_and_apart_from_the_regions(host_bytes: int,
                                                                                  units: list[int]) -> None:
    arenas = [("kv", KvArena(f"a{i}", torch.zeros(4 * u, dtype=torch.uint8), 4, u, u)) for i, u in enumerate(units)]
    layout = validate_layout(KvSpec(16, (GroupSpec("kv", GroupKind.PAGED),)), arenas)
    hl = HostLayout.plan(layout, host_bytes)
    assert hl.slot_table_offset % ALIGN == 0 and hl.slot_table_bytes == 24 * hl.page_slots  # 3 int64 rows
    assert all(r.offset + r.slots * r.unit_bytes <= hl.slot_table_offset for r in hl.regions)
    assert hl.slot_table_offset + hl.slot_table_bytes <= hl.total_bytes
    if hl.page_slots > 1:  # the budget was enough for more than the minimum
        assert hl.total_bytes <= host_bytes


def test_the_index_bumps_a_generation_when_it_hands_a_slot_and_tags_it_when_the_save_commits() -> None:
    idx = HostIndex(4)
    table = idx.slot_table
    base = int(table[GEN, 0])
    assert (table[GEN] == base).all() and (table[TAG] == 0).all()
    keys = [bytes([i + 1]) * 16 for i in range(3)]
    t = idx.reserve_save("r", keys)
    assert not isinstance(t, Shed)
    slots = list(t.page_slots)
    assert table[GEN, slots].tolist() == list(t.page_gens) == [base + 1] * 3  # before the ticket is answered
    assert (table[TAG, slots] == 0).all()  # nothing committed there yet: no belief verifies during the copy
    assert verified_run(table, slots, list(t.page_gens), keys) == 0
    idx.commit_save(t.save_id)
    assert table[TAG, slots].tolist() == key_tags(keys).tolist()
    assert verified_run(table, slots, list(t.page_gens), keys) == 3
    res = idx.query("c", keys)
    assert isinstance(res, Hit) and list(res.page_gens) == list(t.page_gens)  # a query changes nothing
    idx.release_lease(res.lease_id)
    # evicted but not handed again: the bytes are still those pages', and the table still says so
    assert idx._make_room(4, []) and len(idx.entries) == 0
    assert verified_run(table, slots, list(t.page_gens), keys) == 3
    t2 = idx.reserve_save("r2", [b"\x09" * 16])  # handed again: the old belief no longer verifies
    assert not isinstance(t2, Shed) and t2.page_slots[0] in slots
    assert verified_run(table, slots, list(t.page_gens), keys) < 3
    idx.abort_save(t2.save_id)  # an aborted save's bytes may be torn: its slot never verifies for anyone
    s = t2.page_slots[0]
    assert table[TAG, s] == 0


def test_generations_start_at_a_random_base_per_index() -> None:
    assert len({int(HostIndex(2).slot_table[GEN, 0]) for _ in range(8)}) == 8


def test_a_touch_refreshes_recency_like_a_hit() -> None:
    idx = HostIndex(2, high_watermark=1.0)  # evicts only what a save needs
    a, b, c = b"\x01" * 16, b"\x02" * 16, b"\x03" * 16
    for k in (a, b):
        t = idx.reserve_save("r", [k])
        assert not isinstance(t, Shed)
        idx.commit_save(t.save_id)
    assert idx.touch([a, b"\x77" * 16]) == 1  # unknown keys are skipped
    t = idx.reserve_save("r", [c])  # room for c: the least recently used goes, which is b now
    assert not isinstance(t, Shed)
    assert a in idx.entries and b not in idx.entries
    assert idx.counters["touched_pages"] == 1


class _RecordingTier:
    """The tier's side of `TouchBatch`'s contract only: what it is told."""

    def __init__(self) -> None:
        self.calls: list[list[bytes]] = []

    def touch(self, keys: list[bytes]) -> None:
        self.calls.append(keys)


def test_touch_batch_sends_one_message_per_window_against_a_recording_tier() -> None:
    loop = LoopThread("touch-test")
    tier = _RecordingTier()
    try:
        batch = TouchBatch(loop, tier, delay_s=0.05, max_keys=100)  # type: ignore[arg-type]
        for i in range(10):
            batch.add([bytes([i]) * 16, b"\xff" * 16])
        deadline = time.monotonic() + 5
        while not tier.calls and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(tier.calls) == 1 and len(tier.calls[0]) == 11  # one message, each page once
        batch.add([b"\x01" * 16] * 100)  # past max_keys: sent without waiting for the window
        deadline = time.monotonic() + 5
        while len(tier.calls) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert tier.calls[1] == [b"\x01" * 16]
        batch.add([b"\x02" * 16])
        batch.flush()  # the store closing: what is queued goes now
        assert tier.calls[2] == [b"\x02" * 16]
    finally:
        loop.stop()
    batch.add([b"\x03" * 16])  # after the loop closed (a resolve racing the store's close): dropped, never raised
    batch.flush()
    assert len(tier.calls) == 3


# ---- the property ----------------------------------------------------------------------------------------------

SLOTS = 6
KEYS = [bytes([i + 1]) * 16 for i in range(12)]
chains = st.integers(0, 9).flatmap(lambda a: st.integers(1, 3).map(lambda n: KEYS[a : a + n]))


class SeqlockMachine(RuleBasedStateMachine):
    """Saves, commits, aborts, hits, evictions and TTL reaps interleaved with readers that hold beliefs -- true ones
    learned from tickets and hits, and made-up ones -- and copy from slots the way a verified load does: check, copy
    (while anything may happen), check again. The test keeps what each slot really holds and when it was written."""

    def __init__(self) -> None:
        super().__init__()
        self.t = 0.0
        self.idx = HostIndex(SLOTS, high_watermark=0.9, save_ttl_s=5, clock=lambda: self.t)
        self.table = self.idx.slot_table
        self.content: dict[int, bytes] = {}  # slot -> the page whose bytes it holds (complete or not)
        self.complete: dict[int, bool] = {}  # slot -> its last write finished (the save committed)
        self.writes: dict[int, int] = {}  # slot -> writes started so far
        self.tickets: dict[int, list[int]] = {}  # open save -> its slots
        self.beliefs: list[tuple[bytes, int, int]] = []
        self.copies: list[tuple[bytes, int, int, int]] = []  # (key, slot, gen, writes when the copy started)

    @rule(keys=chains)
    def save(self, keys: list[bytes]) -> None:
        t = self.idx.reserve_save("p", keys)
        if isinstance(t, Shed):
            return
        mine = []
        for k, s, g in zip(keys, t.page_slots, t.page_gens):
            if s is None:
                continue
            self.content[s], self.complete[s] = k, False  # the copy worker writes from now until the commit
            self.writes[s] = self.writes.get(s, 0) + 1
            self.beliefs.append((k, s, g))  # a store learns its own ticket
            mine.append(s)
        self.tickets[t.save_id] = mine

    @precondition(lambda self: self.tickets)
    @rule(data=st.data(), commit=st.booleans())
    def settle(self, data: st.DataObject, commit: bool) -> None:
        sid = data.draw(st.sampled_from(sorted(self.tickets)))
        slots = self.tickets.pop(sid)
        if commit and self.idx.commit_save(sid):
            for s in slots:
                self.complete[s] = True
        else:
            self.idx.abort_save(sid)  # its bytes stay torn

    @rule(keys=chains)
    def hit(self, keys: list[bytes]) -> None:
        res = self.idx.query("c", keys)
        if isinstance(res, Hit):
            self.beliefs += list(zip(keys, res.page_slots, res.page_gens))
            self.idx.release_lease(res.lease_id)

    @rule(key=st.sampled_from(KEYS), slot=st.integers(0, SLOTS - 1), dg=st.integers(-1, 1))
    def make_up(self, key: bytes, slot: int, dg: int) -> None:
        self.beliefs.append((key, slot, int(self.table[GEN, slot]) + dg))  # a belief nobody told anyone

    @rule(dt=st.sampled_from([1.0, 6.0]))
    def time_passes(self, dt: float) -> None:
        self.t += dt
        self.idx.reap()
        for sid in [sid for sid in self.tickets if sid not in self.idx.saves]:
            del self.tickets[sid]  # reclaimed by its TTL: aborted, bytes torn

    @precondition(lambda self: self.beliefs)
    @rule(data=st.data())
    def start_copy(self, data: st.DataObject) -> None:
        k, s, g = data.draw(st.sampled_from(self.beliefs))
        if verified_run(self.table, [s], [g], [k]) == 1:  # the check before the Load is ordered
            assert self.content.get(s) == k and self.complete.get(s), "the first check passed a slot not holding k"
            self.copies.append((k, s, g, self.writes.get(s, 0)))

    @precondition(lambda self: self.copies)
    @rule(data=st.data())
    def finish_copy(self, data: st.DataObject) -> None:
        i = data.draw(st.integers(0, len(self.copies) - 1))
        k, s, g, writes = self.copies.pop(i)
        if verified_run(self.table, [s], [g], [k]) == 1:  # the check after the copy's reply
            assert self.writes.get(s, 0) == writes, "a write overlapped a copy the second check kept"
            assert self.content[s] == k and self.complete[s]

    @invariant()
    def every_slot_once(self) -> None:
        s = self.idx.stats()
        assert s["free_page_slots"] + s["entries"] + sum(map(len, self.tickets.values())) == SLOTS


TestSeqlockMachine = SeqlockMachine.TestCase
TestSeqlockMachine.settings = settings(max_examples=examples(150), stateful_step_count=40, deadline=None)
