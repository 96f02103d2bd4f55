"""Byte layout of the host tier's shared-memory arena.

The arena is cut into one region per device arena (in `ArenaLayout` order), then the page-slot table: region `a`
holds `slots_a` consecutive units of `stored_bytes(a)` bytes. A **page slot** `s` is unit `s` of every paged arena's
region (one page of every paged group: aligned groups are saved together); a **bounded slot** `s` of group `g` is unit
`s` of every arena of `g`. Keeping each arena's units contiguous turns a run of consecutive slots into one memcpy
per arena (the copy path coalesces runs of consecutive ids on both sides).

The **slot table** (`slot_table_offset`, 4 KiB-aligned: two int64 rows of `page_slots`, each slot's generation and the
tag of the page it holds committed; `kvproc.tiers.slot_table`) is written by the host tier only. A store maps just this
window (not the KV bytes) to verify a load it started from what it knew, without asking the tier.

Slot counts come from the byte budget: paged groups get what remains after `bounded_fraction` of the budget is set
aside for bounded groups (split by their unit size), and at least one slot each.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvproc.contract import ArenaLayout, GroupKind, KvContractError
from kvproc.tiers.slot_table import ROW_BYTES, ROWS

ALIGN = 4096  # regions start page-aligned so copies of whole units stay aligned
SLOT_TABLE_BYTES = ROWS * ROW_BYTES  # per page slot: its generation and a save-fence word


@dataclass(frozen=True)
class Region:
    arena: str
    group: str
    offset: int
    unit_bytes: int  # stored bytes of one block/slot of this arena
    slots: int


@dataclass(frozen=True)
class HostLayout:
    regions: tuple[Region, ...]
    page_slots: int
    bounded_slots: dict[str, int]
    total_bytes: int
    slot_table_offset: int = -1  # byte offset of the page-slot table; -1: none (verified loads unavailable)

    @property
    def slot_table_bytes(self) -> int:
        return self.page_slots * SLOT_TABLE_BYTES if self.slot_table_offset >= 0 else 0

    @classmethod
    def plan(cls, layout: ArenaLayout, host_bytes: int, bounded_fraction: float = 0.25) -> "HostLayout":
        spec = layout.spec
        paged = [(g, a) for g, a in layout.arenas if spec.group(g).kind is GroupKind.PAGED]
        bounded = [(g, a) for g, a in layout.arenas if spec.group(g).kind is GroupKind.BOUNDED and
                   spec.group(g).checkpointable]
        page_unit = sum(a.stored_bytes for _, a in paged)
        bounded_units: dict[str, int] = {}
        for g, a in bounded:
            bounded_units[g] = bounded_units.get(g, 0) + a.stored_bytes
        budget = max(host_bytes - ALIGN * (len(paged) + len(bounded) + 1), 0)  # each region and the table round up
        bounded_budget = int(budget * bounded_fraction) if bounded_units else 0
        bounded_slots = {g: max(1, bounded_budget // len(bounded_units) // u) for g, u in bounded_units.items()}
        used_bounded = sum(bounded_slots[g] * u for g, u in bounded_units.items())
        # Each page slot costs its units plus its row of the slot table.
        page_slots = max(1, (budget - used_bounded) // (page_unit + SLOT_TABLE_BYTES)) if page_unit else 0
        regions: list[Region] = []
        off = 0
        for g, a in layout.arenas:
            gs = spec.group(g)
            if gs.kind is GroupKind.PAGED:
                n = page_slots
            elif g in bounded_slots:
                n = bounded_slots[g]
            else:
                continue  # not checkpointable: never stored
            regions.append(Region(a.name, g, off, a.stored_bytes, n))
            off += -(-(n * a.stored_bytes) // ALIGN) * ALIGN
        table_offset = off
        off += -(-(max(page_slots, 1) * SLOT_TABLE_BYTES) // ALIGN) * ALIGN
        return cls(tuple(regions), page_slots, bounded_slots, off, table_offset)

    def for_layout(self, layout: ArenaLayout) -> HostLayout:
        """This tier's layout addressed through another rank's arenas (the ranks of a REPLICATED model share one
        tier): region i serves the i-th stored arena of `layout`, which must be of the same group and stored size."""
        spec = layout.spec
        mine = [(g, a) for g, a in layout.arenas
                if spec.group(g).kind is GroupKind.PAGED or spec.group(g).checkpointable]
        if len(mine) != len(self.regions) or any(
                g != r.group or a.stored_bytes != r.unit_bytes for (g, a), r in zip(mine, self.regions)):
            raise KvContractError(
                f"arenas {[(g, a.name, a.stored_bytes) for g, a in mine]} do not match the shared tier's regions "
                f"{[(r.group, r.arena, r.unit_bytes) for r in self.regions]}: the ranks of a REPLICATED model hold "
                "the same KV, so every rank must declare the same groups, arenas and stored sizes")
        return replace(self, regions=tuple(replace(r, arena=a.name) for (_, a), r in zip(mine, self.regions)))

    def region(self, arena: str) -> Region:
        for r in self.regions:
            if r.arena == arena:
                return r
        raise KeyError(f"no host region for arena {arena!r}")
