"""Process discipline for children: a named title and an optional CPU set. (Dying with the launcher:
`parent_death.py`.)"""

from __future__ import annotations

import os
from typing import Sequence


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
