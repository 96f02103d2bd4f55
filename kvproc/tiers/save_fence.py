"""The save fence: a slot handed back by the host tier can never be written by the save it was taken from.

A save is two-phase (`host_index.py`): the tier reserves slots, a copy worker writes them, the store commits. If the
tier gives the slots back before the copy is over (the save's TTL reaped it, or the store aborted it after its copy
deadline while the worker was still stalled), the late copy would land on slots another save now owns, and that
save's readers would restore this save's bytes while every outcome says ok. So each open save owns one **fence word**
in shared memory (the slot table's `FENCE` row, `slot_table.py`), and writing is a claim on it:

- the tier sets the word to the save's token when it hands out the ticket (the ticket carries index and token);
- the copy worker claims the word (`token -> token | WRITING`, one atomic compare-and-swap) before it writes a byte
  of the save, and gives it back (`token | WRITING -> token`) when the write is over; a failed claim writes nothing
  and fails the save (`FenceRevoked`);
- the tier revokes the word (`token -> 0`) before any of the save's slots go back to a free list. A revoke fails while
  a write holds the word: the save is then quarantined (its slots stay out of every free list) and the revoke retried
  by the reaper until the write is over. Once revoked, a claim can never succeed: the slot is unwritable by that save.

So the order is fixed by the word, not by timeouts. A worker killed in the middle of a write leaves its claim behind:
the save's slots stay quarantined (counted, `saves_quarantined`): lost capacity, never wrong bytes -- unless the
store, which launched that worker and sees its process, proves it dead: its `AbortSave(writer_dead=True)` then takes
the word back by force (`force_revoke`) and frees the slots (found leaking by `kvproc bench chaos`; the tier itself
never judges another process's liveness: it may live in another pid namespace).

The compare-and-swap is `kvproc.native._native.fence_cas` (atomic across processes). Without the C module the pure-Python
form reads, compares and writes in three steps: same protocol, but a write racing a revoke in that window is not
excluded (no compiler, no atomics: the C build is what production runs).
"""

from __future__ import annotations

import itertools
import secrets

import numpy as np

from kvproc.native import NATIVE

WRITING = 1 << 62  # set in a fence word while a copy worker writes the save's slots
NO_FENCE = -1  # a ticket without a fence (a layout without a shared table): nothing to claim
REVOKED, BUSY, GONE = "revoked", "busy", "gone"  # what `FenceTable.revoke` found


class FenceRevoked(RuntimeError):
    """The tier has given this save's slots back (TTL, abort): the copy must not write them."""


def _cas(row: np.ndarray, index: int, expected: int, desired: int) -> bool:
    if NATIVE is not None:
        return bool(NATIVE.fence_cas(row, index, expected, desired))
    if int(row[index]) != expected:
        return False
    row[index] = desired
    return True


def claim(row: np.ndarray | None, index: int, token: int) -> None:
    """Before writing a save's slots: take its fence, or raise `FenceRevoked` (write nothing then)."""
    if row is None or index == NO_FENCE:
        return
    if not 0 <= index < row.size or not _cas(row, index, token, token | WRITING):
        raise FenceRevoked(f"save fence {index} no longer holds token {token}: the tier gave the slots back")


def release(row: np.ndarray | None, index: int, token: int) -> None:
    """After the write (whether it completed or failed): let the tier revoke or commit the save again."""
    if row is None or index == NO_FENCE:
        return
    _cas(row, index, token | WRITING, token)


DEFAULT_COPY_TIMEOUT_S = 120.0  # a store's default copy deadline (`ClusterStore.start(copy_timeout_s=)`)


def derived_save_ttl(copy_timeout_s: float, save_ttl_s: float | None = None,
                     tier_call_timeout_s: float = 5.0) -> float:
    """The tier's pending-save TTL for a store whose copies may take `copy_timeout_s`: longer than a save can
    legitimately take (its copy, then its commit), so the reaper only reclaims saves whose store is gone. The save
    fence keeps a reaped save from ever writing slots given back (above); this ordering keeps
    a slow but live save from being failed. An explicit `save_ttl_s` shorter than that is refused."""
    floor = copy_timeout_s + 2 * tier_call_timeout_s
    if save_ttl_s is None:
        return 1.25 * floor
    if save_ttl_s <= floor:
        raise ValueError(f"save_ttl_s={save_ttl_s} must exceed copy_timeout_s + 2 * tier_call_timeout_s = {floor}: "
                         "the tier would reclaim saves whose copy is still allowed to run (they would fail)")
    return save_ttl_s


class FenceTable:
    """The tier's side: hands out fence words and tokens, revokes them. One thread (the index's lock) calls it."""

    def __init__(self, row: np.ndarray) -> None:
        self.row = row
        row[:] = 0
        self._free = list(range(row.size - 1, -1, -1))
        # A random base per incarnation: a token from an earlier tier never matches a word of this one.
        self._tokens = itertools.count((secrets.randbits(40) << 20) + 1)

    def rebind(self, row: np.ndarray) -> None:
        """The table moved (the tier detached its segment): keep the words' values."""
        row[:] = self.row
        self.row = row

    def issue(self) -> tuple[int, int] | None:
        """A free fence word set to a fresh token, or None when every word is taken (the save is shed)."""
        if not self._free:
            return None
        index, token = self._free.pop(), next(self._tokens)
        self.row[index] = token
        return index, token

    def revoke(self, index: int, token: int) -> str:
        """Make the save's slots unwritable by it: "revoked" (done now; the word is free again), "busy" (a copy holds
        the word: retry once it is over) or "gone" (revoked before: the word may be another save's now)."""
        if index == NO_FENCE:
            return REVOKED
        if _cas(self.row, index, token, 0):
            self._free.append(index)
            return REVOKED
        return BUSY if int(self.row[index]) == token | WRITING else GONE

    def force_revoke(self, index: int, token: int) -> bool:
        """Take back a word its dead writer left claimed (its process is gone: no write can be in progress). True if
        it was claimed (it is free again now); False otherwise (an unclaimed word is revoked the usual way)."""
        if index != NO_FENCE and _cas(self.row, index, token | WRITING, 0):
            self._free.append(index)
            return True
        return False

    @property
    def open(self) -> int:
        return self.row.size - len(self._free)
