"""The janitor: a small process outside the launcher's process tree that removes what a killed launcher leaves.

Why it exists: a launcher killed by SIGKILL cannot unlink the segments it owns (an engine's arenas), and children
killed together with it cannot unlink theirs. That is how vLLM's API server stops its engine-core process: SIGTERM,
then at once (its default `--shutdown-timeout 0`) SIGKILL to the engine and every descendant (`kill_process_tree`),
kvproc's host tier and copy worker included. A later kvproc start on the machine sweeps provably dead owners, but
nothing says one will come.

So `launch` starts one janitor per cluster. It is forked by the launcher's forkserver, which was exec'd with only the
fds it needs: the janitor holds none of the launcher's owner locks (`kvproc.ipc.segment_owner`), which would make
the dead launcher look alive. It forks once more and the first half exits, so it is re-parented away from the
launcher's tree (a tree kill, which lists descendants, does not find it), and starts a session of its own (Ctrl-C in
the launcher's terminal does not reach it). Then it blocks on a pidfd of the launcher and on a pipe from it:
- `stop` on the pipe (the launcher's clean shutdown, which removed everything itself): it exits;
- the launcher's exit: it sweeps the cluster's segments whose owners are provably dead (`sweep_dead_segments`: the
  owner locks, whatever the pid namespace), again until none is left (children that outlived the launcher for their
  grace period unlink their own, or die and are swept) or `sweep_deadline_s` passes, removes the runtime dir if its
  marker still names the dead launcher, logs what it did, and exits.
If the janitor itself is killed, the next kvproc start's sweep is the fallback, as before.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from kvproc.ipc import segment_owner
from kvproc.ipc.segment import list_segments, sweep_dead_segments
from kvproc.runtime import manifest as mf
from kvproc.runtime import procutil
from kvproc.runtime.forking import parent_main_hidden
from kvproc.runtime.parent_death import Note
from kvproc.runtime.supervisor import PROCESS_LOCK

STOP = b"stop"


@dataclass(frozen=True)
class JanitorSpec:
    cluster: str
    launcher_pid: int
    runtime_dir: str
    launcher: mf.ProcessIdentity | None  # the runtime dir's marker must still name it for the dir to be removed
    sweep_deadline_s: float = 60.0  # the longest it waits for the dead launcher's children to let go of theirs
    mp_temp_dir: str | None = None  # the launcher's own multiprocessing temp dir (`own_mp_temp_dir`): removed too


class Janitor:
    """The launcher's handle: the janitor's pid and the pipe that stops it."""

    def __init__(self, pid: int, conn: Connection) -> None:
        self.pid = pid
        self._conn: Connection | None = conn

    def stop(self, timeout: float = 2.0) -> None:
        """The cluster cleaned up after itself: the janitor exits (waited for, so no janitor outlives a clean stop:
        its end of the pipe closes as it exits)."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        try:
            conn.send_bytes(STOP)
            if conn.poll(timeout):
                conn.recv_bytes()
        except (EOFError, OSError):
            pass  # gone already
        finally:
            conn.close()


def start_janitor(mp: Any, spec: JanitorSpec, timeout: float = 10.0) -> Janitor:
    """Fork the janitor through `mp` (the launcher's forkserver context); returns once it watches the launcher."""
    ours, theirs = mp.Pipe(duplex=True)
    proc = mp.Process(target=janitor_main, args=(spec, theirs), name=f"kvproc-janitor-{spec.cluster}", daemon=True)
    try:
        with PROCESS_LOCK, parent_main_hidden():
            proc.start()
        theirs.close()
        if not ours.poll(timeout):
            raise RuntimeError(f"the janitor did not report ready within {timeout:g} s")
        reply = ours.recv_bytes()
        if not reply.startswith(b"ready "):
            raise RuntimeError(f"the janitor failed to start: {reply.decode(errors='replace')}")
        with PROCESS_LOCK:  # the first half exits at once (the supervisor never watches it: no sentinel race)
            proc.join(timeout)
    except BaseException:
        ours.close()
        raise
    return Janitor(int(reply.split()[1]), ours)


def janitor_main(spec: JanitorSpec, conn: Connection) -> None:
    """Runs in a forkserver child: forks the janitor and returns (this first half then exits)."""
    try:
        pidfd = os.pidfd_open(spec.launcher_pid)
    except ProcessLookupError:
        pidfd = -1  # the launcher is gone already: sweep at once
    if os.fork() != 0:
        return
    code = 1
    # Its lines go out without blocking: after the launcher's death, nobody may be reading its stderr pipe any more,
    # and a janitor blocked in a write would never exit (issue 39, item 7).
    note = Note("janitor", 0)
    try:
        os.setsid()
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        procutil.set_title(f"kvproc:{spec.cluster}:janitor")
        conn.send_bytes(b"ready %d" % os.getpid())
        code = _watch(spec, pidfd, conn, note)
    except BaseException as e:  # noqa: BLE001 - report, then exit: a janitor never raises into a forkserver
        note.write("janitor_failed", cluster=spec.cluster, error=repr(e))
    finally:
        os._exit(code)


def _watch(spec: JanitorSpec, pidfd: int, conn: Connection, note: Note) -> int:
    if pidfd < 0:
        return _sweep(spec, note)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.register(conn.fileno(), select.POLLIN)
    while True:
        for fd, _ in poller.poll():
            if fd == pidfd:
                return _sweep(spec, note)
            try:
                if conn.recv_bytes() == STOP:
                    conn.close()
                    return 0
            except (EOFError, OSError):
                # The launcher closed the pipe without `stop`: it is exiting (or forgot us): its pidfd decides.
                poller.unregister(fd)


def _left(cluster: str) -> list[str]:
    owners = [f"kvproc.{c}.{r}.{p}.owner" for c, r, p in segment_owner.owner_files() if c == cluster]
    return list_segments(cluster) + owners


def _sweep(spec: JanitorSpec, note: Note) -> int:
    end = time.monotonic() + spec.sweep_deadline_s
    removed: list[str] = []
    while True:
        removed += sweep_dead_segments(cluster=spec.cluster)
        left = _left(spec.cluster)
        if not left or time.monotonic() > end:
            break
        time.sleep(0.1)
    dir_removal = mf.remove_runtime_dir(spec.runtime_dir, spec.launcher) if spec.runtime_dir else None
    if spec.mp_temp_dir:  # only the dead launcher used it (its forkserver's socket): nobody else can
        shutil.rmtree(spec.mp_temp_dir, ignore_errors=True)
    note.write("janitor_swept_after_launcher_death", level="warning", cluster=spec.cluster,
               launcher_pid=spec.launcher_pid, segments=removed, left=left,
               runtime_dir=dir_removal.message if dir_removal else None, mp_temp_dir=spec.mp_temp_dir)
    return 0 if not left else 1
