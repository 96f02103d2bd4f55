"""Shared-memory segments: exclusive creation, cross-process bytes, safe close under live views, the sweep."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import stat
import subprocess
import sys
from collections.abc import Iterator

import numpy as np
import posix_ipc
import pytest

from kvproc.ipc import pinning
from kvproc.ipc.segment import (
    SHM_DIR,
    Segment,
    SegmentBusyError,
    SegmentError,
    list_segments,
    parse_name,
    sweep_dead_segments,
)
from kvproc.ipc.segment_owner import OwnerLockError, owner_path

CLUSTER = f"segtest{os.getpid()}"  # this run's own: the fixture cleans only what it started


@pytest.fixture(autouse=True)
def no_segment_left_behind() -> Iterator[None]:
    yield
    leftovers = list_segments(CLUSTER)
    for name in leftovers:
        os.unlink(os.path.join(SHM_DIR, name))
    assert not leftovers, f"segments left behind: {leftovers}"


def _write_pattern(name: str, value: int) -> None:
    seg = Segment.attach(name)
    view = seg.numpy(np.uint8)
    view[:] = value
    del view
    seg.close()


def test_segment_is_private_named_after_owner_and_sized() -> None:
    with Segment.create(CLUSTER, "host_tier", 1 << 20) as seg:
        st = os.stat(os.path.join(SHM_DIR, seg.name))
        assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_size == 1 << 20
        parsed = parse_name(seg.name)
        assert parsed is not None and (parsed.cluster, parsed.role, parsed.pid) == (CLUSTER, "host_tier", os.getpid())


def test_bytes_written_by_one_process_are_read_by_another() -> None:
    with Segment.create(CLUSTER, "host_tier", 64 * 1024) as seg:
        p = multiprocessing.get_context("forkserver").Process(target=_write_pattern, args=(seg.name, 0xAB))
        p.start()
        p.join(20)
        assert p.exitcode == 0
        view = seg.numpy(np.uint8)
        assert view.min() == 0xAB and view.max() == 0xAB
        del view


def test_attach_does_not_truncate_and_sees_creator_writes() -> None:
    with Segment.create(CLUSTER, "copy_worker", 8192) as seg:
        seg.numpy(np.int64)[:] = np.arange(1024)
        other = Segment.attach(seg.name)
        assert other.nbytes == 8192 and not other.owner
        assert np.array_equal(other.numpy(np.int64, offset=8, count=3), [1, 2, 3])
        other.close()


def test_a_window_maps_only_its_pages_and_sees_the_creators_later_writes() -> None:
    """What a store does with the host tier's slot table: map one page-aligned window, read what the owner writes."""
    with Segment.create(CLUSTER, "host_tier", 4 * 4096) as seg:
        owner = seg.numpy(np.int64)
        window = Segment.attach(seg.name, offset=2 * 4096, nbytes=4096)
        assert window.nbytes == 4096 and not window.owner
        view = window.numpy(np.int64)  # counts from the window's start
        owner[2 * 512 : 2 * 512 + 3] = [7, 8, 9]  # written after the window was mapped
        assert view[:3].tolist() == [7, 8, 9] and view.size == 512
        del view
        window.close()
        with pytest.raises(ValueError):
            Segment.attach(seg.name, offset=100)  # not page-aligned
        with pytest.raises(SegmentError):
            Segment.attach(seg.name, offset=3 * 4096, nbytes=2 * 4096)  # past the end
        del owner


def test_close_with_live_numpy_view_raises_and_the_view_stays_valid() -> None:
    seg = Segment.create(CLUSTER, "host_tier", 4096)
    seg.unlink()
    view = seg.numpy(np.uint8)[10:20]  # a derived view also holds the export
    with pytest.raises(SegmentBusyError):
        seg.close()
    view[:] = 7
    assert int(view.sum()) == 70
    del view
    seg.close()
    assert seg.closed


def test_close_with_live_torch_view_raises_instead_of_segfaulting() -> None:
    torch = pytest.importorskip("torch")
    seg = Segment.create(CLUSTER, "copy_worker", 4096)
    seg.unlink()
    t = seg.torch(torch.float32)[4:8]
    with pytest.raises(SegmentBusyError):
        seg.close()
    t.fill_(1.5)
    assert float(t.sum()) == 6.0
    del t
    seg.close()


def test_too_large_segment_fails_cleanly_and_leaves_no_name() -> None:
    free = os.statvfs(SHM_DIR).f_bavail * os.statvfs(SHM_DIR).f_frsize
    with pytest.raises(SegmentError, match="cannot allocate"):
        Segment.create(CLUSTER, "host_tier", free + (1 << 30))


def _orphan(role: str) -> str:
    """A segment whose creator died without unlinking it (a child that exits at once, skipping every cleanup)."""
    code = ("import os; from kvproc.ipc.segment import Segment; "
            f"s = Segment.create({CLUSTER!r}, {role!r}, 4096); print(s.name, flush=True); os._exit(0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def test_sweep_removes_segments_of_provably_dead_owners_only() -> None:
    dead_name = _orphan("x")
    dead_pid = parse_name(dead_name).pid  # type: ignore[union-attr]
    assert os.path.exists(owner_path(CLUSTER, "x", dead_pid))  # the dead owner's lock file, free now
    with Segment.create(CLUSTER, "live", 4096) as live:
        assert set(list_segments(CLUSTER)) == {dead_name, live.name}
        assert sweep_dead_segments(CLUSTER) == [dead_name]
        assert list_segments(CLUSTER) == [live.name]
        assert not os.path.exists(owner_path(CLUSTER, "x", dead_pid))  # its lock file went with it
        assert os.path.exists(owner_path(CLUSTER, "live", os.getpid()))
    assert not os.path.exists(owner_path(CLUSTER, "live", os.getpid()))  # the last unlink drops this one's file


def test_a_segment_whose_owner_cannot_be_proven_dead_is_kept() -> None:
    """No owner lock file (a pid of another namespace, or an older kvproc): a free pid here proves nothing."""
    gone = subprocess.Popen(["true"])
    gone.wait(10)
    name = f"kvproc.{CLUSTER}.nolock.{gone.pid}.0"
    posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
    try:
        assert sweep_dead_segments(CLUSTER) == []
        assert name in list_segments(CLUSTER)
    finally:
        posix_ipc.unlink_shared_memory("/" + name)


def _lock_holder(path: str) -> subprocess.Popen[str]:
    """Another process holding the owner lock `path` (a live owner, whatever its pid looks like from here)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600);"
         " fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); time.sleep(120)", path],
        stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder


def test_a_live_owner_of_another_pid_namespace_keeps_its_segments() -> None:
    """The container case: the segment names a pid that is free here, but its owner lock is held (by a process
    that, seen from here, has another pid): the sweep must leave it alone."""
    gone = subprocess.Popen(["true"])
    gone.wait(10)
    name = f"kvproc.{CLUSTER}.other.{gone.pid}.0"
    path = owner_path(CLUSTER, "other", gone.pid)
    holder = _lock_holder(path)
    try:
        posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
        assert sweep_dead_segments(CLUSTER) == []
        assert name in list_segments(CLUSTER)
        holder.kill()
        holder.wait(10)
        assert sweep_dead_segments(CLUSTER) == [name]  # once the owner is gone, its lock is free: proven dead
        assert not os.path.exists(path)
    finally:
        holder.kill()
        holder.wait(10)
        if os.path.exists(path):
            os.unlink(path)
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_shared_memory("/" + name)


def test_a_second_live_owner_of_the_same_identity_is_refused() -> None:
    """Two processes of two pid namespaces with the same cluster, role and pid would clash on segment names: the
    second one's creation fails with the reason instead of sharing (or sweeping) the first one's segments."""
    path = owner_path(CLUSTER, "clash", os.getpid())
    holder = _lock_holder(path)
    try:
        with pytest.raises(OwnerLockError, match="another pid namespace"):
            Segment.create(CLUSTER, "clash", 4096)
        assert not list_segments(CLUSTER)
    finally:
        holder.kill()
        holder.wait(10)
        if os.path.exists(path):
            os.unlink(path)


def test_pinning_is_a_no_op_without_cuda() -> None:
    with Segment.create(CLUSTER, "copy_worker", 4096) as seg:
        assert pinning.register(seg) is False
        pinning.unregister(seg)
        assert not seg.pinned


def _mapped_rss(name: str) -> int:
    """Bytes of this process's mapping of segment `name` that are resident (its page tables filled)."""
    rss, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            first = line.split(maxsplit=1)[0]
            if "-" in first and not first.endswith(":"):  # a mapping's header line
                inside = line.rstrip().endswith("/" + name)
            elif inside and first == "Rss:":
                rss += int(line.split()[1]) << 10
    return rss


@pytest.mark.parametrize("madvise", ["populate_write", "fallback_touch"])
def test_a_new_segment_is_populated_up_front_in_chunks(madvise: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Its pages are resident at creation (no page fault on a copy's hot path), filled in chunks (one MAP_POPULATE of
    a whole multi-GiB segment held the process's memory-map lock for a second and more: other threads stalled,
    heartbeats failed). Both ways: madvise(MADV_POPULATE_WRITE), and the one-byte-per-page touch of older kernels.
    Control (by hand): without `_populate` the mapping's Rss is 0."""
    from kvproc.ipc import segment as seg_mod

    monkeypatch.setattr(seg_mod, "_POPULATE_CHUNK", 4 << 20)  # several chunks, and a short last one
    if madvise == "fallback_touch":
        monkeypatch.setattr(seg_mod, "_MADV_POPULATE_WRITE", 0x7FFF)  # unknown advice: EINVAL, the fallback runs
    nbytes = (18 << 20) + 4096
    with Segment.create(CLUSTER, "host_tier", nbytes) as seg:
        assert _mapped_rss(seg.name) == nbytes
        view = seg.numpy(np.uint8)
        assert not view.any()  # populated, still zero
        del view
