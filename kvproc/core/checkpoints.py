"""The one checkpoint index of a rank.

A checkpoint at page boundary t is the set of sealed artifacts of every group at t, keyed by the chained hash of the
page ending at t. Paged artifacts are implicit: the paged index maps every sealed page's hash to its block, so the
pages up to t are the chain of matched blocks. Bounded artifacts are explicit: `entries[hash][group] = staging slot`.

For a paged-only model every page boundary is a checkpoint. With restorable bounded groups, only boundaries where
every non-optional bounded group has a sealed copy are; a hit restores the deepest such boundary inside the paged
match (pages past it are recomputed from the checkpoint: one index at the granularity of the sparsest checkpointer,
deliberately).
"""

from __future__ import annotations

from typing import Sequence

from kvproc.contract import GroupSpec


class CheckpointIndex:
    def __init__(self, bounded: Sequence[GroupSpec]) -> None:
        self.groups = tuple(g.name for g in bounded)
        self.required = tuple(g.name for g in bounded if not g.optional)
        self.entries: dict[bytes, dict[str, int]] = {}

    @property
    def has_bounded(self) -> bool:
        return bool(self.groups)

    def get(self, key: bytes, group: str) -> int | None:
        entry = self.entries.get(key)
        return None if entry is None else entry.get(group)

    def add(self, key: bytes, group: str, slot: int) -> bool:
        """Record a sealed copy; False if the entry already has this group (the caller drops the duplicate)."""
        entry = self.entries.setdefault(key, {})
        if group in entry:
            return False
        entry[group] = slot
        return True

    def replace(self, key: bytes, group: str, slot: int) -> int | None:
        """Record a sealed copy, displacing any existing one (returned, so the caller can forget its key)."""
        entry = self.entries.setdefault(key, {})
        old = entry.get(group)
        entry[group] = slot
        return old

    def drop(self, key: bytes, group: str) -> None:
        entry = self.entries.get(key)
        if entry is not None:
            entry.pop(group, None)
            if not entry:
                del self.entries[key]

    def deepest_complete(self, hashes: Sequence[bytes], usable_pages: int) -> tuple[int, dict[str, int], bool]:
        """(pages, artifacts, saw_incomplete) of the deepest complete checkpoint within the first `usable_pages`.

        Walks down from the deepest usable boundary; checkpoints are sparse but the walk stops at the first complete
        one, so its cost is bounded by the checkpoint interval, not the prompt length.
        """
        if not self.required:
            # Only optional bounded groups (or none): every page boundary is a checkpoint; take what artifacts exist.
            entry = self.entries.get(hashes[usable_pages - 1], {}) if usable_pages else {}
            return usable_pages, dict(entry), False
        entries, required = self.entries, self.required
        saw_incomplete = False
        for pages in range(usable_pages, 0, -1):
            found = entries.get(hashes[pages - 1])
            if found is None:
                continue
            if all(g in found for g in required):
                return pages, dict(found), saw_incomplete
            saw_incomplete = True
        return 0, {}, saw_incomplete
