"""The host tier's page-slot table: int64 rows of `page_slots` entries in the host arena
(`HostLayout.slot_table_offset`), written by the host tier's index only, read in shared memory by the processes that
copy pages in and out of the tier's slots:

- `GEN`: each slot's generation. It goes up each time the slot is handed to a save, before that save is answered, so
  before any copy into the slot can be ordered; it starts at a random base per tier incarnation. A hit names each
  slot's generation, and a process that copies out of leased slots itself compares them after its copy
  (`store/tier_slots.py`, `TierSlots.intact`): equal, no save was handed the slot meanwhile, so nothing wrote it.
- `FENCE`: not per slot: the save fences (`kvproc.tiers.save_fence`), one word per open save, which a writer claims
  before writing a save's slots; there are as many as page slots.

(A third row once tagged each slot with its committed page, for stores that loaded pages before asking the tier and
verified them against the table afterwards; that path went with the blocking resolver: bench/RESULTS.md, "Control
path".)
"""

from __future__ import annotations

GEN, FENCE = 0, 1  # the table's rows
ROW_BYTES = 8  # one int64 per slot and row
ROWS = 2
