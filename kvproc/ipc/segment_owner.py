"""Owner locks: how a sweep proves that a segment's creator is dead, in any pid namespace.

A pid says nothing across containers that share /dev/shm: a live owner in another pid namespace looks dead here (no
such pid), and a pid reused here looks alive. So a process that creates segments for `(cluster, role)` first takes
an exclusive `flock` on the file `/dev/shm/kvproc.<cluster>.<role>.<pid>.owner` and keeps it open until its last
segment of that identity is unlinked (or it dies: the kernel drops the lock with the process, wherever it ran). A
sweep unlinks a segment only when it can take that lock itself; no lock file means "cannot prove", and the segment
is kept.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time
from collections.abc import Iterator

SHM_DIR = "/dev/shm"
_lock = threading.Lock()
_held: dict[tuple[str, str, int], list[int]] = {}  # (cluster, role, pid) -> [fd, live segments]


class OwnerLockError(RuntimeError):
    """Another live process holds the owner lock of the same (cluster, role, pid): a name clash across pid
    namespaces that share /dev/shm, which would make both processes' segments collide."""


def owner_path(cluster: str, role: str, pid: int) -> str:
    return os.path.join(SHM_DIR, f"kvproc.{cluster}.{role}.{pid}.owner")


def _same_file(fd: int, path: str) -> bool:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    own = os.fstat(fd)
    return (own.st_dev, own.st_ino) == (st.st_dev, st.st_ino)


def hold(cluster: str, role: str) -> None:
    """Count one more live segment of this process under `(cluster, role)`, taking the owner lock for the first."""
    key = (cluster, role, os.getpid())  # a forked child has a pid of its own, so it never reuses its parent's entry
    with _lock:
        entry = _held.get(key)
        if entry is not None:
            entry[1] += 1
            return
        path = owner_path(*key)
        deadline = time.monotonic() + 1.0
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                # A sweeper may hold it for a moment while it removes a dead owner's leftovers under this name.
                if time.monotonic() > deadline:
                    raise OwnerLockError(f"{path} is held by another live process: a process of another pid "
                                         f"namespace uses the same cluster, role and pid") from None
                time.sleep(0.01)
                continue
            if _same_file(fd, path):  # a sweeper did not unlink the file between our open and our lock
                break
            os.close(fd)
        _held[key] = [fd, 1]


def release(cluster: str, role: str) -> None:
    """One segment of this process under `(cluster, role)` was unlinked; the last one drops the lock and its file."""
    key = (cluster, role, os.getpid())
    with _lock:
        entry = _held.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _held[key]
        with contextlib.suppress(FileNotFoundError):
            os.unlink(owner_path(*key))  # while still locked, so no sweeper judges it in between
        os.close(entry[0])


@contextlib.contextmanager
def claim_if_dead(cluster: str, role: str, pid: int) -> Iterator[bool]:
    """Yields True while holding the owner lock of a provably dead owner (its lock file exists and nobody holds
    it); the caller unlinks its segments, and the lock file goes when the block ends. False: alive or unknown."""
    path = owner_path(cluster, role, pid)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        if not _same_file(fd, path):  # swept by someone else meanwhile
            yield False
            return
        yield True
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    finally:
        os.close(fd)


def owner_files() -> list[tuple[str, str, int]]:
    """`(cluster, role, pid)` of every owner lock file in /dev/shm (held or not)."""
    found = []
    for entry in os.listdir(SHM_DIR):
        parts = entry.split(".")
        if len(parts) == 5 and parts[0] == "kvproc" and parts[4] == "owner" and parts[3].isdigit():
            found.append((parts[1], parts[2], int(parts[3])))
    return found


def held_identities() -> list[tuple[str, str, int]]:
    """`(cluster, role, pid)` of the owner locks this process holds, read WITHOUT `_lock`: for a dying process
    (`kvproc.runtime.parent_death`), which must not wait on a lock another thread may hold. `list(dict)` is one step
    under the GIL; a concurrent hold/release only makes the answer a moment old."""
    return list(_held)
