"""The host tier's slot table (`kvproc/tiers/slot_table.py`): where it sits in the host arena, and the generations the
index writes into it, which a process that copies out of leased slots itself checks after its copy
(`TierSlots.intact`)."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproc.contract import GroupKind, GroupSpec, KvArena, KvSpec, validate_layout
from kvproc.tiers.host_index import Hit, HostIndex, Shed
from kvproc.tiers.layout import ALIGN, HostLayout
from kvproc.tiers.slot_table import GEN
from tests.hypothesis_budget import examples


@settings(max_examples=examples(50), deadline=None)
@given(host_bytes=st.integers(8 * 4096, 1 << 22), units=st.lists(st.sampled_from([64, 256, 2048, 5000]), min_size=1,
                                                                      max_size=3))
def test_the_layout_keeps_the_table_inside_the_budget_and_apart_from_the_regions(host_bytes: int,
                                                                                  units: list[int]) -> None:
    arenas = [("kv", KvArena(f"a{i}", torch.zeros(4 * u, dtype=torch.uint8), 4, u, u)) for i, u in enumerate(units)]
    layout = validate_layout(KvSpec(16, (GroupSpec("kv", GroupKind.PAGED),)), arenas)
    hl = HostLayout.plan(layout, host_bytes)
    assert hl.slot_table_offset % ALIGN == 0 and hl.slot_table_bytes == 16 * hl.page_slots  # 2 int64 rows
    assert all(r.offset + r.slots * r.unit_bytes <= hl.slot_table_offset for r in hl.regions)
    assert hl.slot_table_offset + hl.slot_table_bytes <= hl.total_bytes
    if hl.page_slots > 1:  # the budget was enough for more than the minimum
        assert hl.total_bytes <= host_bytes


def test_the_index_bumps_a_generation_when_it_hands_a_slot_and_hits_name_it() -> None:
    idx = HostIndex(4)
    table = idx.slot_table
    base = int(table[GEN, 0])
    assert (table[GEN] == base).all()
    keys = [bytes([i + 1]) * 16 for i in range(3)]
    t = idx.reserve_save("r", keys)
    assert not isinstance(t, Shed)
    slots = list(t.page_slots)
    assert table[GEN, slots].tolist() == [base + 1] * 3  # before the ticket is answered
    idx.commit_save(t.save_id)
    res = idx.query("c", keys)
    assert isinstance(res, Hit) and list(res.page_gens) == [base + 1] * 3  # a query changes nothing
    idx.release_lease(res.lease_id)
    assert idx._make_room(4, []) and len(idx.entries) == 0  # evicted, not handed again: the generation stays
    assert table[GEN, slots].tolist() == [base + 1] * 3
    t2 = idx.reserve_save("r2", [b"\x09" * 16])  # handed again: a copy that read the old page no longer checks out
    assert not isinstance(t2, Shed) and t2.page_slots[0] in slots
    assert int(table[GEN, t2.page_slots[0]]) == base + 2


def test_generations_start_at_a_random_base_per_index() -> None:
    assert len({int(HostIndex(2).slot_table[GEN, 0]) for _ in range(8)}) == 8
