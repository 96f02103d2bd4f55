"""Self-profiling while serving: a sampler thread reads every thread's stack every few ms for N seconds.

Sampling (`sys._current_frames`) sees all threads -- the socket thread and every handler -- unlike cProfile, which
only sees the thread that enabled it, and it costs the serving threads nothing but the GIL time of each sample.
The report is plain text: the hottest frames (self and total samples) and collapsed stacks (flamegraph input).
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from types import FrameType
from typing import Callable


def _stack(frame: FrameType | None) -> list[str]:
    out = []
    while frame is not None:
        code = frame.f_code
        out.append(f"{code.co_name} ({os.path.basename(code.co_filename)}:{frame.f_lineno})")
        frame = frame.f_back
    out.reverse()
    return out


def sample(
    seconds: float, interval_s: float = 0.005, should_stop: Callable[[], bool] = lambda: False
) -> tuple[collections.Counter[str], int]:
    """Collapsed stacks ("thread;outer;...;inner" -> count) of every thread but this one."""
    me = threading.get_ident()
    names = {t.ident: t.name for t in threading.enumerate()}
    stacks: collections.Counter[str] = collections.Counter()
    samples = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end and not should_stop():
        for ident, frame in sys._current_frames().items():
            if ident != me:
                stacks[";".join([names.get(ident, str(ident)), *_stack(frame)])] += 1
        samples += 1
        time.sleep(interval_s)
    return stacks, samples


def write_report(path: str, title: str, stacks: collections.Counter[str], samples: int, seconds: float) -> None:
    own: collections.Counter[str] = collections.Counter()
    total: collections.Counter[str] = collections.Counter()
    for stack, n in stacks.items():
        frames = stack.split(";")[1:]
        if frames:
            own[frames[-1]] += n
        for frame in set(frames):
            total[frame] += n
    lines = [f"# kvproc profile: {title}", f"# {samples} samples over {seconds:.1f}s, all threads", ""]
    lines.append("## hottest frames by self samples")
    lines += [f"{n:8d}  {name}" for name, n in own.most_common(30)]
    lines += ["", "## hottest frames by total samples"]
    lines += [f"{n:8d}  {name}" for name, n in total.most_common(30)]
    lines += ["", "## collapsed stacks (thread;outer;...;inner count)"]
    lines += [f"{s} {n}" for s, n in stacks.most_common()]
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)
