"""The load fence: a load order the store gave up on can never write the blocks it was sent for.

A load writes host bytes into device blocks the store reserved for it. When the store stops waiting for the copy
worker (the worker was declared dead by heartbeats: stopped or starved for 3 s, not necessarily gone), it frees those
blocks, and other requests compute their pages into them. A worker that was only stalled then resumes and runs the
Load still queued on its socket, over those pages: they hold another prompt's bytes while every outcome says ok
(found by `kvproc bench chaos`; `tests/tiers/test_load_fence.py`).

The same word protocol as the save fence (`kvproc/tiers/save_fence.py`), with the store as the side that revokes:
each `RemoteCopier` owns a row of int64 fence words in a segment the scheduler creates (sent to the worker in
`AttachArenas`); a load order carries its word's index and token; the worker claims the word (`token -> token |
WRITING`, atomic) before it writes a byte and gives it back after; the store revokes it (`token -> 0`) when the load
is settled, before the blocks can be freed:

- revoked: the worker either finished or will never start (its claim fails: `fence_revoked`): the blocks are safe;
- busy: the worker is in the middle of the write (stopped or killed mid-copy): the store waits until the write ends,
  or until the worker's process is gone (then nothing can write: the word is taken back by force). The worker is
  known by its pid *and its start time* (`ProcessId`): once it is dead the kernel may give its pid to another
  process, which must not read as the worker still alive (the wait would never end).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from kvproc.tiers.save_fence import BUSY, GONE, REVOKED, FenceTable

LOAD_FENCE_WORDS = 1024  # loads in flight per copier at once (each resolving thread has one, plus abandoned ones)
SETTLE_POLL_S = 0.02  # while a stalled worker holds a word mid-write: how often to look again


def _stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat's fields after the command name (state first), or None: no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None


@dataclass(frozen=True)
class ProcessId:
    """A process: its pid and its start time (clock ticks after boot, /proc/<pid>/stat field 22; 0: unknown)."""

    pid: int
    start: int = 0

    @classmethod
    def of(cls, pid: int) -> ProcessId:
        """Read while the process is known alive (it has just answered): later, its pid may name another one."""
        fields = _stat(pid) if pid > 0 else None
        return cls(pid, int(fields[19]) if fields is not None and len(fields) > 19 else 0)


def process_gone(proc: ProcessId | int) -> bool:
    """The process is dead (exited, a zombie, or its pid now names a process started later): it cannot write
    anything any more. A bare pid (no start time known) already reused by another process reads as alive: the
    caller keeps waiting (never wrong bytes)."""
    if isinstance(proc, int):
        proc = ProcessId(proc)
    if proc.pid <= 0:
        return False
    fields = _stat(proc.pid)
    if fields is None or fields[0] in ("Z", "X"):
        return True
    return bool(proc.start) and len(fields) > 19 and int(fields[19]) != proc.start


class LoadFences:
    """The store's side of one copier's load fences (thread-safe: resolving threads and the loop both load)."""

    def __init__(self, row: np.ndarray) -> None:
        self._table = FenceTable(row)
        self._lock = threading.Lock()
        self.forced = 0  # words taken back from a worker that died mid-write
        self.waited = 0  # settles that found a write in progress and waited for it

    def issue(self) -> tuple[int, int] | None:
        with self._lock:
            return self._table.issue()

    def try_settle(self, index: int, token: int, writer_pid: ProcessId | int) -> bool:
        """Make the load unwritable: True once done (the word is free again), False while a live worker writes."""
        with self._lock:
            state = self._table.revoke(index, token)
            if state in (REVOKED, GONE):
                return True
            assert state == BUSY
            if process_gone(writer_pid) and self._table.force_revoke(index, token):  # BUSY: it was claimed
                self.forced += 1
                return True
            return False

    @property
    def open(self) -> int:
        return self._table.open
