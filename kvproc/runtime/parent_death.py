"""A child's launcher died: leave at once, without waiting on anything another thread can hold.

Why this shape (issue 39, item 7): a host tier once outlived its SIGKILLed `kvproc up` by minutes. Its watcher
thread was blocked on a lock while the main thread sat in `zmq_msg_recv`. The old death path logged through
structlog (its per-stream lock, then the stream's buffer lock, then a `write` that blocks while the stderr pipe is
full: a supervisor that stopped reading it), asked the server to stop in order and slept a grace period before
`os._exit`. Any one of those waits can last forever. So the death path here (`ParentWatch.die`):
1. unlinks this process's shared-memory segments by name (plain `unlink` syscalls, no Python lock: not
   `Segment.unlink`, which takes `segment_owner`'s lock). Owner-lock files stay: the kernel drops our lock as we exit
   and the janitor's sweep (or the next start's) removes them -- and with them any segment a thread was creating
   at this very moment, which an early removal of its owner file would leave unprovable, hence kept, forever;
2. writes one JSON line on a descriptor opened at start with O_NONBLOCK (an open file description of its own on
   stderr's pipe or tty, so the flag does not change the stream the process shares with others): dropped, not
   waited for, when the pipe is full;
3. `os._exit(1)`: no atexit handler, no ZeroMQ context termination, no flush of a Python stream.
No threading lock is taken on the way. The GIL is the one lock left, and every thread gives it up around each
blocking call and at least every switch interval.

Two triggers end there: a thread blocked on a pidfd of the launcher (no polling), and the SIGTERM that
`PR_SET_PDEATHSIG` sends when the forkserver (the child's OS parent) exits, which it does once the launcher is gone:
that signal's handler (`child.py`) dies the same way when the launcher is gone, and stops in order otherwise.
"""

from __future__ import annotations

import ctypes
import datetime
import errno
import json
import os
import select
import signal
import stat
import threading
import time
from typing import Any, NoReturn

from kvproc.ipc import segment_owner

_PR_SET_PDEATHSIG = 1
_SHM_DIR = "/dev/shm"
_POLL_FALLBACK_S = 0.5  # only without pidfd support (Linux < 5.3, or a sandbox refusing the call)


class Note:
    """One best-effort JSON line on stderr that never blocks: a full pipe drops it."""

    def __init__(self, role: str, rank: int) -> None:
        self._fields: dict[str, Any] = {"role": role, "rank": rank}
        self.fd = _open_nonblocking(2)

    def write(self, event: str, level: str = "error", **fields: Any) -> bool:
        if self.fd < 0:
            return False
        stamp = datetime.datetime.fromtimestamp(time.time(), datetime.timezone.utc).isoformat()  # no libc tz lock
        line = {"event": event, "level": level, "timestamp": stamp, **self._fields, "pid": os.getpid(), **fields}
        data = (json.dumps(line, default=repr) + "\n").encode()
        try:
            return os.write(self.fd, data) == len(data)
        except OSError:  # EAGAIN (a full pipe nobody reads), EPIPE (nobody at all): the line is lost, not waited for
            return False


def _open_nonblocking(fd: int) -> int:
    """A descriptor on what `fd` refers to whose writes never wait for a reader; -1 when none can be had (a socket).

    A regular file never makes a write wait: `fd` itself (a dup: same offset, so the line lands after the ones the
    process wrote, not over them). A pipe or a tty: a new open file description through /proc with O_NONBLOCK, so
    that the flag does not change the stream this process shares with others."""
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return os.dup(fd)
        return os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return -1


def unlink_own_segments() -> list[str]:
    """Unlink every segment this process created and still holds, by name; no Python lock is taken (`list(dict)`
    is one step under the GIL, and a dict being changed at that moment only makes this best-effort)."""
    pid = os.getpid()
    prefixes = tuple(f"kvproc.{c}.{r}.{p}." for c, r, p in segment_owner.held_identities() if p == pid)
    if not prefixes:
        return []
    removed = []
    for name in os.listdir(_SHM_DIR):
        if name.startswith(prefixes) and not name.endswith(".owner"):
            try:
                os.unlink(os.path.join(_SHM_DIR, name))
                removed.append(name)
            except OSError:  # swept meanwhile: nothing to do
                pass
    return removed


class ParentWatch:
    """Ends this process when the launcher exits. `arm()` once, early in the child, before any other thread."""

    def __init__(self, launcher_pid: int, note: Note) -> None:
        self.launcher_pid = launcher_pid
        self._note = note
        self._pidfd = -1

    def arm(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        try:
            self._pidfd = os.pidfd_open(self.launcher_pid)
        except ProcessLookupError:
            self.die("launcher_gone_at_start")
        except OSError as e:
            # No pidfds here: poll the pid instead (a reused pid would hide the death; PR_SET_PDEATHSIG still comes
            # when the forkserver follows the launcher out).
            if e.errno not in (errno.ENOSYS, errno.EPERM, errno.EACCES):
                raise
        threading.Thread(target=self._watch, name="kvproc-parent-watch", daemon=True).start()

    def launcher_gone(self) -> bool:
        """Non-blocking: has the launcher exited?"""
        if self._pidfd >= 0:
            poller = select.poll()
            poller.register(self._pidfd, select.POLLIN)
            return bool(poller.poll(0))
        try:
            os.kill(self.launcher_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False

    def _watch(self) -> None:
        if self._pidfd >= 0:
            poller = select.poll()
            poller.register(self._pidfd, select.POLLIN)
            poller.poll()  # blocks until the launcher exits
        else:
            while not self.launcher_gone():
                time.sleep(_POLL_FALLBACK_S)
        self.die("launcher_died")

    def die(self, why: str) -> NoReturn:
        """The lock-free exit (module docstring). Safe from any thread and from a signal handler."""
        try:
            removed = unlink_own_segments()
            self._note.write(why, launcher_pid=self.launcher_pid, segments_unlinked=removed)
        finally:
            os._exit(1)
