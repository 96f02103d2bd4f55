"""`Segment`: a POSIX shared-memory segment with zero-copy numpy/torch views that can never dangle.

- Created exclusively (O_CREX), mode 0600, named `kvproc.<cluster>.<role>.<owner pid>.<n>`, under the creator's
  owner lock (`segment_owner`), so that a sweep removes it only once it can prove the creator dead, whatever pid
  namespace the creator ran in; sized with `posix_fallocate` so a too-small /dev/shm fails here with ENOSPC instead of a SIGBUS on
  first write; mapped with MAP_POPULATE so page faults are paid at creation/attach, never on a hot path.
- Attached by name with size 0 (a non-zero size would truncate the segment).
- Every view is a numpy array over the mmap (torch views via `torch.from_numpy`, never `torch.frombuffer`, which
  does not hold a buffer export). While any view lives, `mmap.close()` raises BufferError, so `close()` raises
  `SegmentBusyError` instead of unmapping memory a view still points into (which would segfault on next access).
- Unlink removes the name at once; existing mappings keep working and the memory is freed with the last mapping.
"""

from __future__ import annotations

import itertools
import mmap
import os
import re
from typing import TYPE_CHECKING, Any, Iterable, NamedTuple

import numpy as np
import posix_ipc

from kvproc.ipc import segment_owner

if TYPE_CHECKING:
    import torch

SHM_DIR = "/dev/shm"
_NAME_RE = re.compile(r"^kvproc\.([A-Za-z0-9_-]+)\.([A-Za-z0-9_-]+)\.(\d+)\.(\d+)$")
_PART_RE = re.compile(r"^[A-Za-z0-9_-]{1,40}$")
_seq = itertools.count()

# Page tables of a new segment are filled up front (no page fault later on a copy's hot path), in chunks: one
# MAP_POPULATE of the whole mapping holds the process's memory-map lock throughout, and every other thread that
# allocates stalls behind it (a 2 GiB host tier stalled its socket thread ~0.9 s on a busy 2-core machine; at 8 GiB
# heartbeats fail and the tier is declared dead at attach). Between chunks the lock is free.
_POPULATE_CHUNK = 64 << 20
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux >= 5.14; 23 on every architecture


def _populate(mm: mmap.mmap, nbytes: int) -> None:
    for off in range(0, nbytes, _POPULATE_CHUNK):
        n = min(_POPULATE_CHUNK, nbytes - off)
        try:
            mm.madvise(_MADV_POPULATE_WRITE, off, n)
        except OSError:  # an older kernel: fault the pages in by writing one byte per page (they are zero already)
            view = np.frombuffer(mm, dtype=np.uint8, count=n, offset=off)
            view[:: mmap.PAGESIZE] = 0
            del view


class SegmentError(RuntimeError):
    """Creating or attaching a segment failed (the message says which segment and why)."""


class SegmentBusyError(SegmentError):
    """`close()` was called while views of the segment are still alive."""


class SegmentName(NamedTuple):
    cluster: str
    role: str
    pid: int
    seq: int


def parse_name(name: str) -> SegmentName | None:
    match = _NAME_RE.match(name.lstrip("/"))
    if match is None:
        return None
    return SegmentName(match[1], match[2], int(match[3]), int(match[4]))


def _check_part(what: str, value: str) -> None:
    if not _PART_RE.match(value):
        raise ValueError(f"segment {what} {value!r} must be 1-40 characters of [A-Za-z0-9_-]")


class Segment:
    def __init__(self, name: str, mm: mmap.mmap, nbytes: int, owner: bool) -> None:
        self.name = name
        self.nbytes = nbytes
        self.owner = owner  # True in the creating process (the one that unlinks)
        self._mm: mmap.mmap | None = mm
        self.pinned = False  # set by kvproc.ipc.pinning
        self._owner_held = owner  # this process counts the segment under its owner lock until it unlinks it

    @classmethod
    def create(cls, cluster: str, role: str, nbytes: int) -> Segment:
        _check_part("cluster", cluster)
        _check_part("role", role)
        if nbytes <= 0:
            raise ValueError(f"segment size must be positive, got {nbytes}")
        name = f"kvproc.{cluster}.{role}.{os.getpid()}.{next(_seq)}"
        segment_owner.hold(cluster, role)  # before the name exists, so no sweep ever sees it without a live owner
        try:
            shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=0)
        except BaseException:
            segment_owner.release(cluster, role)
            raise
        try:
            try:
                os.posix_fallocate(shm.fd, 0, nbytes)
            except OSError as e:
                free = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
                raise SegmentError(
                    f"cannot allocate {nbytes} B for segment {name}: {e.strerror} ({SHM_DIR} has {free} B free)"
                ) from e
            mm = mmap.mmap(shm.fd, nbytes, flags=mmap.MAP_SHARED)
            _populate(mm, nbytes)
        except BaseException:
            shm.close_fd()
            shm.unlink()
            segment_owner.release(cluster, role)
            raise
        shm.close_fd()  # the mapping keeps the memory; the fd is not needed any more
        return cls(name, mm, nbytes, owner=True)

    @classmethod
    def attach(cls, name: str, *, offset: int = 0, nbytes: int = -1) -> Segment:
        """Map a segment another process created (never unlinked here). `offset` / `nbytes` map only that window
        (`offset` a multiple of the page size; views then count from the window's start): a store reads the host
        tier's page-slot table without mapping the whole arena."""
        if offset < 0 or offset % mmap.ALLOCATIONGRANULARITY:
            raise ValueError(f"window offset {offset} is not a multiple of {mmap.ALLOCATIONGRANULARITY}")
        try:
            shm = posix_ipc.SharedMemory("/" + name.lstrip("/"), 0, size=0)  # size 0: never truncate
        except posix_ipc.ExistentialError as e:
            raise SegmentError(f"no segment named {name}: {e}") from e
        try:
            size = shm.size
            if nbytes < 0:
                nbytes = size - offset
            if nbytes <= 0 or offset + nbytes > size:
                raise SegmentError(f"window [{offset}, +{nbytes}) is outside segment {name} ({size} B)")
            mm = mmap.mmap(shm.fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE, offset=offset)
        finally:
            shm.close_fd()
        return cls(name.lstrip("/"), mm, nbytes, owner=False)

    # ---- views ----

    def _map(self) -> mmap.mmap:
        if self._mm is None:
            raise SegmentError(f"segment {self.name} is closed")
        return self._mm

    def numpy(self, dtype: Any = np.uint8, offset: int = 0, count: int = -1) -> np.ndarray[Any, Any]:
        """A writable zero-copy view; `count=-1` means to the end of the segment."""
        return np.frombuffer(self._map(), dtype=dtype, count=count, offset=offset)

    def torch(self, dtype: torch.dtype | None = None, offset: int = 0, count: int = -1) -> torch.Tensor:
        """A zero-copy CPU tensor, built through numpy so that it keeps the mapping's buffer export alive."""
        import torch

        dtype = dtype or torch.uint8
        itemsize = torch.empty((), dtype=dtype).element_size()
        nbytes = (self.nbytes - offset if count < 0 else count * itemsize) // itemsize * itemsize
        raw = torch.from_numpy(self.numpy(np.uint8, offset, nbytes))
        return raw.view(dtype)  # the view keeps `raw`'s storage, which keeps the numpy array, which keeps the map

    # ---- lifetime ----

    @property
    def closed(self) -> bool:
        return self._mm is None

    def close(self) -> None:
        """Unmap. Raises SegmentBusyError (and stays mapped) while any view is alive."""
        if self._mm is None:
            return
        if self.pinned:
            from kvproc.ipc import pinning

            pinning.unregister(self)
        try:
            self._mm.close()
        except BufferError as e:
            raise SegmentBusyError(f"segment {self.name} still has live views; drop them before closing") from e
        self._mm = None

    def unlink(self) -> None:
        try:
            posix_ipc.unlink_shared_memory("/" + self.name)
        except posix_ipc.ExistentialError:
            pass
        if self._owner_held:
            self._owner_held = False
            parsed = parse_name(self.name)
            assert parsed is not None
            segment_owner.release(parsed.cluster, parsed.role)

    def address(self) -> int:
        """The mapping's base address (for pinned-memory registration)."""
        view = self.numpy(np.uint8, 0, 1)
        return int(view.ctypes.data)

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.owner:
            self.unlink()
        self.close()

    def __repr__(self) -> str:
        return f"Segment({self.name!r}, {self.nbytes} B, owner={self.owner}, closed={self.closed})"


def list_segments(cluster: str | None = None) -> list[str]:
    names = []
    for entry in os.listdir(SHM_DIR):
        parsed = parse_name(entry)
        if parsed is not None and (cluster is None or parsed.cluster == cluster):
            names.append(entry)
    return sorted(names)


def sweep_dead_segments(cluster: str | None = None, pids: Iterable[int] | None = None) -> list[str]:
    """Unlink kvproc segments whose creator is provably dead (optionally only these pids / this cluster): its owner
    lock file exists and nobody holds it. A pid alone proves nothing (containers sharing /dev/shm have pid
    namespaces of their own), so a segment without an owner lock file is kept. Owner lock files left without
    segments by dead processes go too."""
    only = set(pids) if pids is not None else None
    by_owner: dict[tuple[str, str, int], list[str]] = {}
    for entry in list_segments(cluster):
        parsed = parse_name(entry)
        assert parsed is not None
        by_owner.setdefault((parsed.cluster, parsed.role, parsed.pid), []).append(entry)
    for owner in segment_owner.owner_files():
        if cluster is None or owner[0] == cluster:
            by_owner.setdefault(owner, [])
    removed = []
    for (c, role, pid), entries in sorted(by_owner.items()):
        if only is not None and pid not in only:
            continue
        with segment_owner.claim_if_dead(c, role, pid) as dead:
            if not dead:
                continue
            for entry in entries:
                try:
                    posix_ipc.unlink_shared_memory("/" + entry)
                    removed.append(entry)
                except posix_ipc.ExistentialError:  # someone else swept it first
                    pass
    return removed
