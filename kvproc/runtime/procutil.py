"""Process discipline for children: a named title, dying with the launcher, and an optional CPU set.

Children are forked by the forkserver, so their OS parent is the forkserver, not the launcher. Two mechanisms:
- `PR_SET_PDEATHSIG(SIGTERM)`: the kernel signals us when the forkserver exits, which it does as soon as the
  launcher is gone (it reads EOF on its "alive" pipe);
- a launcher-pid check: a thread blocks on a pidfd of the launcher (no polling) and stops us when it exits, which
  also covers a forkserver that outlives the launcher.
Either way the child stops in order (its role unlinks its segments), and is force-exited after a grace period.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import threading
import time
from typing import Callable, Sequence

import structlog

log = structlog.get_logger(__name__)

_PR_SET_PDEATHSIG = 1


def set_title(title: str) -> None:
    try:
        import setproctitle

        setproctitle.setproctitle(title)
    except Exception:  # cosmetic: never fail a start over a title
        pass


def check_cpus(cpus: Sequence[int], what: str) -> tuple[int, ...]:
    """`cpus` as a sorted tuple, if every one is a CPU of this machine; else ValueError naming them. (Not only the
    caller's own set: an engine pinned to its cores may place kvproc's processes on others.)"""
    machine = set(range(os.cpu_count() or 1))
    want = tuple(sorted(set(int(c) for c in cpus)))
    if not want or not set(want) <= machine:
        raise ValueError(f"{what}: cpus {list(want)} must be a non-empty subset of this machine's CPUs "
                         f"({sorted(machine)})")
    return want


def pin_cpus(cpus: Sequence[int]) -> None:
    """Run this process -- every thread it has now and, inherited, every thread it starts later -- on `cpus` only.

    Why a child may want it: a copy worker woken by a resolve may otherwise run on the engine's busy cores, behind
    their work and on caches full of it; placed on cores of its own (near its GPU on a real machine) it is not.
    Measured both ways by `kvproc bench ipc --kvproc-cpus` (bench/RESULTS.md: on a 2-vCPU machine it moves
    microseconds, not the ratio to a raw round trip)."""
    cpus = check_cpus(cpus, "pin_cpus")
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no procfs: the calling thread (later threads inherit from it)
        threads = [0]
    for tid in threads:
        try:
            os.sched_setaffinity(tid, cpus)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


def die_with_parent(launcher_pid: int, on_parent_death: Callable[[], None], grace_s: float = 3.0) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() == 1:  # our parent died before prctl took effect: the signal would never come
        on_parent_death()
    try:
        pidfd = os.pidfd_open(launcher_pid)
    except ProcessLookupError:
        log.error("launcher_already_gone", launcher_pid=launcher_pid)
        os._exit(1)

    def watch() -> None:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        poller.poll()  # blocks until the launcher exits
        log.error("launcher_died", launcher_pid=launcher_pid)
        on_parent_death()
        time.sleep(grace_s)
        log.error("forced_exit_after_launcher_death", grace_s=grace_s)
        os._exit(1)

    threading.Thread(target=watch, name="kvproc-parent-watch", daemon=True).start()
