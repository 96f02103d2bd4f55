"""The host tier's page-slot table: what a store reads, without asking, to know a copy from a slot read one page.

Int64 rows of `page_slots` entries in the host arena (`HostLayout.slot_table_offset`), written by the host tier's
index only, mapped by stores (just that window, never the KV bytes):

- `GEN`: the slot's generation. It goes up each time the slot is handed to a save, before that save is answered, so
  before any copy into the slot can be ordered. It starts at a random base per tier incarnation, so a pair learned
  from an earlier incarnation does not match a later one.
- `TAG`: which page's bytes the slot holds *committed*: the first 8 bytes of the page's key, written when its save
  commits (after the copy landed), cleared to 0 when the slot is handed to a save. An eviction keeps it (the bytes
  are still that page's until the slot is handed again); an aborted save leaves 0 (its bytes may be torn).

A seqlock read (`verified_run`), for a store that believes page `k` sits in slot `s` at generation `g` (its
`SlotCache`): check `TAG[s] == tag(k)` and `GEN[s] == g` before ordering the copy (so the slot held `k`'s committed
bytes then), and `GEN[s] == g` again after the copy's completion came back (no save was handed the slot meanwhile, so
nothing wrote it: the copy read exactly `k`'s bytes). Nothing in the belief is trusted: a wrong slot fails the tag, a
stale generation fails the generation, a save still being written fails the tag. Ordering: the tier's writes and the
copies are ordered by the messages between them (a save's copy starts after the ticket that followed its generation
bump; a commit's tag follows the copy's reply), and each check reads after the event it follows (the first before the
Load is sent, the second after its reply is received).

A third row, `FENCE`, is not about slots: its words are the save fences (`kvproc.tiers.save_fence`), one per open save,
which the copy workers claim before writing a save's slots; there are as many as page slots.

A key whose first 8 bytes are zero never verifies (0 means "nothing committed"): it just goes the query's way.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from kvproc.native import NATIVE

GEN, TAG, FENCE = 0, 1, 2  # the table's rows (FENCE: one word per open save, `save_fence.py`; not per slot)
ROW_BYTES = 8  # one int64 per slot and row
ROWS = 3


def key_tags(keys: Sequence[bytes]) -> np.ndarray:
    """The tag of each key: its first 8 bytes as a little-endian int64 (zero-padded if shorter)."""
    n = len(keys)
    if not n:
        return np.zeros(0, dtype=np.int64)
    size = len(keys[0])
    joined = b"".join(keys)
    if size >= 8 and len(joined) == n * size:  # the usual case: one digest size, one reshape
        return np.frombuffer(joined, dtype=np.uint8).reshape(n, size)[:, :8].copy().view("<i8").ravel()
    return np.array([int.from_bytes(k[:8].ljust(8, b"\0"), "little", signed=True) for k in keys], dtype=np.int64)


def verified_run(table: np.ndarray, slots: Sequence[int], gens: Sequence[int], keys: Sequence[bytes]) -> int:
    """How many leading (slot, generation, key) beliefs the table confirms right now: the slot holds that key's
    committed bytes at that generation. Call before ordering a copy from them and again after its completion came back
    (module docstring); the second call's count is what the copy may keep."""
    if NATIVE is not None and type(slots) is list and type(gens) is list and type(keys) is list:
        # One C pass (~1 us for 64 pages; the numpy form below costs ~30 us hot, several times that right after a
        # wait, on a resolve's critical path twice).
        return int(NATIVE.slot_verify(table[GEN], table[TAG], slots, gens, keys))
    n = min(len(slots), len(gens), len(keys))
    if not n:
        return 0
    idx = np.asarray(slots[:n], dtype=np.int64)
    inside = (idx >= 0) & (idx < table.shape[1])
    at = np.where(inside, idx, 0)
    tags = key_tags(keys[:n])
    same = inside & (table[GEN, at] == np.asarray(gens[:n], dtype=np.int64)) & (table[TAG, at] == tags) & (tags != 0)
    return n if same.all() else int(same.argmin())
