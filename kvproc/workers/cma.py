"""Cross-memory attach: move KV blocks between another process's private memory and this one's, by address.

The CPU analogue of a CUDA IPC handle. An engine that allocated its KV tensors itself (vLLM does) cannot hand kvproc
a shared-memory segment; it can hand its pid and the tensors' addresses, and a kvproc process then reads
(`process_vm_readv`) or writes (`process_vm_writev`) those bytes directly: one system call per batch of up to
`IOV_MAX` (1,024) scattered blocks on each side, no copy through a pipe or a socket, no code on the engine's thread.

Permission is the kernel's ptrace check: same user, and where Yama's `ptrace_scope` is 1 the engine must have named
the mover (`allow_mover(pid)`: `prctl(PR_SET_PTRACER, pid)`) or be its ancestor. A refusal raises `CmaError` with the
errno's name, never a partial silent copy: a short transfer is continued until done or raised.

Linux only (>= 3.2); `CmaMover.available()` says whether this kernel and libc have it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
from typing import Sequence

IOV_MAX = 1024  # Linux's UIO_MAXIOV: the most iovecs one call takes on each side


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


class CmaError(OSError):
    """A cross-memory transfer failed (no permission, no such process, a bad address)."""


_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_readv = getattr(_libc, "process_vm_readv", None)
_writev = getattr(_libc, "process_vm_writev", None)
for _f in (_readv, _writev):
    if _f is not None:
        _f.restype = ctypes.c_ssize_t
        _f.argtypes = [ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.POINTER(_IoVec), ctypes.c_ulong,
                       ctypes.c_ulong]

PR_SET_PTRACER = 0x59616D61


def allow_mover(pid: int) -> None:
    """Called in the engine's process: let process `pid` read and write this one's memory where Yama restricts
    ptrace to ancestors (a no-op elsewhere)."""
    if _libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(pid), 0, 0, 0) != 0:
        e = ctypes.get_errno()
        if e != errno.EINVAL:  # EINVAL: no Yama in this kernel, nothing to allow
            raise CmaError(e, f"prctl(PR_SET_PTRACER, {pid}): {os.strerror(e)}")


class CmaMover:
    """Moves (remote address, local address, length) spans between this process and process `pid`."""

    def __init__(self, pid: int) -> None:
        if _readv is None or _writev is None:
            raise CmaError(errno.ENOSYS, "process_vm_readv/process_vm_writev are not available in this libc")
        self.pid = pid

    @staticmethod
    def available() -> bool:
        return _readv is not None and _writev is not None

    def read(self, spans: Sequence[tuple[int, int, int]]) -> int:
        """Copy each (remote, local, nbytes) span from the other process into this one; returns bytes moved."""
        return self._move(_readv, spans, "process_vm_readv")

    def write(self, spans: Sequence[tuple[int, int, int]]) -> int:
        """Copy each (remote, local, nbytes) span from this process into the other one."""
        return self._move(_writev, spans, "process_vm_writev")

    def _move(self, fn: object, spans: Sequence[tuple[int, int, int]], what: str) -> int:
        total = 0
        for start in range(0, len(spans), IOV_MAX):
            batch = spans[start:start + IOV_MAX]
            n = len(batch)
            local = (_IoVec * n)(*[_IoVec(lo, ln) for _, lo, ln in batch])
            remote = (_IoVec * n)(*[_IoVec(ro, ln) for ro, _, ln in batch])
            want = sum(ln for _, _, ln in batch)
            got = fn(self.pid, local, n, remote, n, 0)  # type: ignore[operator]
            if got < 0:
                e = ctypes.get_errno()
                raise CmaError(e, f"{what}(pid {self.pid}, {n} spans, {want} bytes): {errno.errorcode.get(e, e)} "
                                  f"{os.strerror(e)}")
            if got != want:  # a partial transfer stops at a span boundary or inside one: finish the rest
                got += self._finish(fn, batch, got, what)
            total += got
        return total

    def _finish(self, fn: object, batch: Sequence[tuple[int, int, int]], done: int, what: str) -> int:
        moved = 0
        for ro, lo, ln in batch:
            if done >= ln:
                done -= ln
                continue
            ro, lo, ln = ro + done, lo + done, ln - done
            done = 0
            while ln:
                one_l, one_r = _IoVec(lo, ln), _IoVec(ro, ln)
                got = fn(self.pid, ctypes.byref(one_l), 1, ctypes.byref(one_r), 1, 0)  # type: ignore[operator]
                if got <= 0:
                    e = ctypes.get_errno() if got < 0 else errno.EFAULT
                    raise CmaError(e, f"{what}(pid {self.pid}): short transfer at remote {ro:#x}, {ln} bytes left: "
                                      f"{os.strerror(e)}")
                moved += got
                ro, lo, ln = ro + got, lo + got, ln - got
        return moved


def block_spans(remote_base: int, remote_ids: Sequence[int], local_base: int, local_ids: Sequence[int],
                block_bytes: int, remote_stride: int | None = None, local_stride: int | None = None
                ) -> list[tuple[int, int, int]]:
    """(remote, local, nbytes) spans for block `remote_ids[i]` <-> `local_ids[i]`, runs of consecutive ids on both
    sides coalesced into one span (fewer iovecs, one memcpy each in the kernel)."""
    rs, ls = remote_stride or block_bytes, local_stride or block_bytes
    if len(remote_ids) != len(local_ids):
        raise ValueError(f"{len(remote_ids)} remote blocks for {len(local_ids)} local ones")
    spans: list[tuple[int, int, int]] = []
    contiguous = rs == block_bytes and ls == block_bytes
    i = 0
    while i < len(remote_ids):
        j = i + 1
        if contiguous:
            while j < len(remote_ids) and remote_ids[j] == remote_ids[j - 1] + 1 and \
                    local_ids[j] == local_ids[j - 1] + 1:
                j += 1
        spans.append((remote_base + remote_ids[i] * rs, local_base + local_ids[i] * ls, (j - i) * block_bytes))
        i = j
    return spans
