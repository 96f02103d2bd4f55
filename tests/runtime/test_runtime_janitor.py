"""The janitor (`kvproc/runtime/janitor.py`): a launcher SIGKILLed together with its whole process tree (how vLLM's
API server stops its engine core) leaves nothing in /dev/shm and no runtime dir; a clean stop leaves no janitor."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from kvproc.ipc import segment_owner
from kvproc.ipc.segment import list_segments
from kvproc.runtime import RoleConfig, launch

# Unique to this test process: the checks count by cluster name (other pytest runs share /dev/shm).
JT = f"jt{os.getpid()}"

_LAUNCHER = textwrap.dedent("""
    import sys, time
    from kvproc.ipc.segment import Segment
    from kvproc.runtime import RoleConfig, launch
    cluster = launch([RoleConfig("host_tier", options={"segment_bytes": 65536}), RoleConfig("copy_worker")],
                     cluster_name=sys.argv[1], runtime_dir=sys.argv[2])
    arena = Segment.create(sys.argv[1], "arena", 1 << 16)  # the launcher's own (an engine's arena)
    from multiprocessing import util
    print("ready", cluster._janitor[0].pid if cluster._janitor else 0, util.get_temp_dir(), flush=True)
    time.sleep(600)
""")


def _left(cluster: str) -> list[str]:
    return list_segments(cluster) + [f"{r}.{p}.owner" for c, r, p in segment_owner.owner_files() if c == cluster]


def _wait_gone(pid: int, timeout: float) -> bool:
    try:
        psutil.Process(pid).wait(timeout)
    except psutil.NoSuchProcess:
        pass
    except psutil.TimeoutExpired:
        return False
    return True


def test_a_launcher_killed_with_its_whole_tree_leaves_nothing(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    cluster, runtime_dir = JT + "k", str(tmp_path / "rt")
    # The launcher's TMPDIR: its multiprocessing temp dir is made here, seen by this test only. Short, under /tmp, not
    # in tmp_path: the forkserver's socket path in it must fit AF_UNIX's 108 bytes (a pytest-xdist worker's tmp_path
    # is longer, and the janitor then did not start).
    tmp = Path(tempfile.mkdtemp(prefix="jt", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(tmp, ignore_errors=True))
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]), TMPDIR=str(tmp))
    proc = subprocess.Popen([sys.executable, "-c", _LAUNCHER, cluster, runtime_dir], stdout=subprocess.PIPE,
                            text=True, env=env)
    janitor = 0
    try:
        assert proc.stdout is not None
        line = ""
        for line in proc.stdout:  # its log lines first (structlog writes to stdout)
            if line.startswith("ready"):
                break
        assert line.startswith("ready"), f"the launcher did not start: {line!r}"
        janitor, mp_dir = int(line.split()[1]), line.split()[2]
        assert os.path.isdir(mp_dir) and mp_dir.startswith(str(tmp))
        assert len(list_segments(cluster)) == 2  # the host tier's and the launcher's own
        assert os.path.isdir(runtime_dir)
        tree = psutil.Process(proc.pid).children(recursive=True)
        assert janitor not in {p.pid for p in tree}, "the janitor is in the launcher's tree: a tree kill finds it"
        # vLLM's kill_process_tree: every descendant SIGKILLed, then the process itself.
        for p in tree:
            p.send_signal(signal.SIGKILL)
        proc.kill()
        proc.wait(30)
        end = time.monotonic() + 90  # generous: the machine may be loaded; no timing is asserted
        while (_left(cluster) or os.path.exists(runtime_dir) or os.path.exists(mp_dir)) and time.monotonic() < end:
            time.sleep(0.1)
        assert not _left(cluster), f"left in /dev/shm: {_left(cluster)}"
        assert not os.path.exists(runtime_dir)
        # issue 35's residual: the launcher's multiprocessing temp dir (its forkserver's socket) went with it
        assert not os.path.exists(mp_dir), f"left: {os.listdir(mp_dir)}"
        assert _wait_gone(janitor, 30), "the janitor did not exit after its sweep"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if janitor and psutil.pid_exists(janitor):
            _wait_gone(janitor, 90)


def test_a_clean_shutdown_stops_the_janitor_and_it_leaves_no_process() -> None:
    c = launch([RoleConfig("copy_worker")], cluster_name=JT + "c")
    (j,) = c._janitor
    assert psutil.Process(j.pid).ppid() != os.getpid()  # re-parented away from the launcher
    c.shutdown()
    assert _wait_gone(j.pid, 30)
    assert not _left(JT + "c")
