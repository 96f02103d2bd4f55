"""Operator safety of runtime dirs and pids (issue 15, items 10-12): kvproc never deletes a directory it did not
mark as its own, and `kvproc down --force` never signals a pid that is no longer the process kvproc started.

Every test touches only what it starts: its own temp dirs and its own processes (killed by the test itself)."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator

import pytest

from kvproc.runtime import manifest as mf
from kvproc.runtime import standalone

UP_TIMEOUT_S = 60  # a loaded machine: `kvproc up` starts a forkserver and a host tier


def _kvproc(*args: str, timeout: float = UP_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvproc", *args], capture_output=True, text=True, timeout=timeout)


Sleeper = Callable[[], "subprocess.Popen[bytes]"]


def _alive(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is None


@pytest.fixture
def sleeper() -> Iterator[Sleeper]:
    """Starts sleeping processes of this test's own, each killed (if still alive) and reaped when the test ends."""
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        procs.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]))
        return procs[-1]

    yield start
    for p in procs:  # only the processes this test started
        if p.poll() is None:
            p.kill()
        p.wait(10)


def _short_dir(name: str) -> str:
    # ipc socket paths are limited to 107 bytes: pytest's tmp_path can be long, so use a short sibling under /tmp
    path = f"/tmp/kvos-{os.getpid()}-{name}"
    assert not os.path.lexists(path)
    return path


@pytest.fixture
def short_dirs() -> Iterator[list[str]]:
    made: list[str] = []
    yield made
    for path in made:  # only the dirs this test made
        shutil.rmtree(path, ignore_errors=True)


def _up(runtime_dir: str, cluster: str) -> subprocess.Popen[str]:
    log = tempfile.TemporaryFile()  # not a pipe: a chatty child must never block on a full one
    up = subprocess.Popen([sys.executable, "-m", "kvproc", "up", "--cluster", cluster, "--runtime-dir", runtime_dir,
                           "--host-mib", "8"], stdout=subprocess.PIPE, stderr=log, text=True)
    assert up.stdout is not None
    line = up.stdout.readline()
    if "up; manifest" not in line:
        up.kill()
        up.wait(10)
        log.seek(0)
        pytest.fail(f"kvproc up did not come up: {line!r} {log.read()[-2000:]!r}")
    log.close()  # the child keeps its own descriptor
    return up


def _fake_cluster(runtime_dir: str, launcher: mf.ProcessIdentity | None,
                  children: list[tuple[int, mf.ProcessIdentity | None]], marked: bool = True) -> None:
    """A runtime dir as a launcher leaves it: manifest, token and (if `marked`) kvproc's marker, with the given pids
    and recorded identities; its control endpoint answers nothing."""
    os.makedirs(runtime_dir, mode=0o700)
    launcher_pid = launcher.pid if launcher is not None else 0
    procs = [mf.ProcessEntry("host_tier", r, pid, f"ipc://{runtime_dir}/host_tier-{r}.sock", identity=ident)
             for r, (pid, ident) in enumerate(children)]
    mf.write_manifest(runtime_dir, mf.Manifest(mf.MANIFEST_VERSION, "fake", runtime_dir, launcher_pid, time.time(),
                                               f"ipc://{runtime_dir}/launcher.sock", procs,
                                               launcher_identity=launcher))
    mf.write_token(runtime_dir)
    if marked:
        mf.write_marker(runtime_dir, mf.RuntimeMarker(mf.MARKER_VERSION, "fake", True, launcher))


def _wrong_start(ident: mf.ProcessIdentity) -> mf.ProcessIdentity:
    return mf.ProcessIdentity(ident.pid, ident.start_ticks + 12345, ident.boot_id, ident.pid_ns)


# ---- item 10: a directory kvproc did not create is never cleared or removed ----


def test_up_refuses_an_unmarked_non_empty_dir_and_leaves_its_files(short_dirs: list[str]) -> None:
    rd = _short_dir("user")
    short_dirs.append(rd)
    os.makedirs(rd)
    precious = os.path.join(rd, "precious.txt")
    pathlib.Path(precious).write_text("the operator's data")
    out = _kvproc("up", "--cluster", "osu", "--runtime-dir", rd, "--host-mib", "8")
    assert out.returncode == 2, (out.stdout, out.stderr[-2000:])
    assert rd in out.stderr and mf.RUNTIME_MARKER in out.stderr and "not empty" in out.stderr, out.stderr
    assert pathlib.Path(precious).read_text() == "the operator's data"
    assert sorted(os.listdir(rd)) == ["precious.txt"]  # nothing added, nothing removed


def test_prepare_refuses_an_unmarked_dir_even_with_a_dead_launchers_manifest(tmp_path: pathlib.Path) -> None:
    rd = str(tmp_path / "rd")
    _fake_cluster(rd, None, [], marked=False)  # looks like kvproc's, but kvproc never marked it
    (tmp_path / "rd" / "notes").write_text("keep me")
    with pytest.raises(mf.RuntimeDirError, match="no .kvproc-runtime marker"):
        mf.prepare_runtime_dir("osx", rd)
    assert (tmp_path / "rd" / "notes").read_text() == "keep me"
    assert not mf.remove_runtime_dir(rd).done and os.path.exists(tmp_path / "rd" / "notes")


def test_up_and_down_keep_an_empty_dir_the_operator_made(short_dirs: list[str]) -> None:
    """An existing empty dir is adopted (marked, not created): `down` empties it and keeps the directory."""
    rd = _short_dir("empty")
    short_dirs.append(rd)
    os.makedirs(rd)
    inode = os.stat(rd).st_ino
    up = _up(rd, "ose")
    try:
        assert mf.read_marker(rd) is not None and mf.read_marker(rd).created_dir is False  # type: ignore[union-attr]
        out = _kvproc("down", "--runtime-dir", rd, "--timeout", "20")
        assert out.returncode == 0, (out.stdout, out.stderr[-2000:])
        assert "stopped" in out.stdout and f"emptied runtime dir {rd}" in out.stdout, out.stdout
        assert up.wait(20) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
    assert os.path.isdir(rd) and os.stat(rd).st_ino == inode and os.listdir(rd) == []


def test_down_never_deletes_an_unmarked_dir(short_dirs: list[str], sleeper: Sleeper) -> None:
    rd = _short_dir("unmarked")
    short_dirs.append(rd)
    gone = sleeper()
    ident = mf.process_identity(gone.pid)
    gone.kill()
    gone.wait(10)
    _fake_cluster(rd, ident, [], marked=False)
    (pathlib.Path(rd) / "notes").write_text("keep me")
    out = _kvproc("down", "--runtime-dir", rd, "--timeout", "1", "--force")
    assert "kept runtime dir" in out.stdout + out.stderr, (out.stdout, out.stderr)
    assert (pathlib.Path(rd) / "notes").read_text() == "keep me"
    assert {"manifest.json", "token", "notes"} <= set(os.listdir(rd))


# ---- item 12 (runtime dirs): `down` removes the dir it made and says so; crashed launchers' dirs are swept ----


def test_down_removes_the_runtime_dir_kvproc_created_and_says_so(short_dirs: list[str]) -> None:
    rd = _short_dir("made")
    short_dirs.append(rd)
    up = _up(rd, "osm")
    try:
        marker = mf.read_marker(rd)
        assert marker is not None and marker.created_dir and marker.launcher is not None
        assert marker.launcher.pid == up.pid
        manifest = mf.read_manifest(rd)
        assert manifest.launcher_identity == marker.launcher
        assert all(p.identity is not None and p.identity.pid == p.pid for p in manifest.processes)
        out = _kvproc("down", "--runtime-dir", rd, "--timeout", "20")
        assert out.returncode == 0, (out.stdout, out.stderr[-2000:])
        assert f"stopped; removed runtime dir {rd}" in out.stdout, out.stdout
        assert up.wait(20) == 0
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)
    assert not os.path.lexists(rd)


def test_a_crashed_launchers_marked_dir_is_swept_but_a_live_ones_is_kept(tmp_path: pathlib.Path,
                                                                         sleeper: Sleeper
                                                                         ) -> None:
    base = tmp_path / "base"
    base.mkdir()
    dead = sleeper()
    dead_ident = mf.process_identity(dead.pid)
    dead.kill()
    dead.wait(10)
    live = sleeper()
    live_ident = mf.process_identity(live.pid)
    _fake_cluster(str(base / "crashed"), dead_ident, [])
    _fake_cluster(str(base / "running"), live_ident, [])
    _fake_cluster(str(base / "reused"), _wrong_start(live_ident), [])  # type: ignore[arg-type]  # pid now another's
    _fake_cluster(str(base / "unmarked"), dead_ident, [], marked=False)
    swept = mf.sweep_stale_runtime_dirs(str(base))
    assert sorted(os.listdir(base)) == ["running", "unmarked"], swept
    assert len(swept) == 2 and all(m.startswith("removed runtime dir") for m in swept)
    with pytest.raises(mf.ClusterRunningError, match="already running"):
        mf.prepare_runtime_dir("fake", str(base / "running"))
    assert _alive(live)


def test_up_reclaims_a_dir_whose_launcher_pid_was_reused(tmp_path: pathlib.Path,
                                                         sleeper: Sleeper) -> None:
    """The pid is alive, but not as the launcher that was recorded: that launcher is dead, the dir is reclaimable."""
    other = sleeper()
    ident = mf.process_identity(other.pid)
    assert ident is not None
    rd = str(tmp_path / "rd")
    _fake_cluster(rd, _wrong_start(ident), [])
    assert mf.prepare_runtime_dir("osr", rd) == rd
    assert os.listdir(rd) == [mf.RUNTIME_MARKER]
    marker = mf.read_marker(rd)
    assert marker is not None and marker.launcher == mf.process_identity(os.getpid()) and marker.created_dir
    assert mf.remove_runtime_dir(rd, marker.launcher).done and not os.path.lexists(rd)
    assert _alive(other)


# ---- item 11: `down --force` signals only the processes recorded at launch ----


def test_down_force_does_not_signal_a_pid_whose_start_time_does_not_match(
        tmp_path: pathlib.Path, sleeper: Sleeper, capsys: pytest.CaptureFixture[str]) -> None:
    launcher, stranger = sleeper(), sleeper()
    launcher_ident, stranger_ident = mf.process_identity(launcher.pid), mf.process_identity(stranger.pid)
    assert launcher_ident is not None and stranger_ident is not None
    rd = str(tmp_path / "rd")
    # the stranger holds a child's pid, but the child recorded at launch started at another time: a reused pid
    _fake_cluster(rd, launcher_ident, [(stranger.pid, _wrong_start(stranger_ident))])
    rc = standalone.down_main(["--runtime-dir", rd, "--timeout", "0.5", "--force"])
    err = capsys.readouterr().err
    assert rc == 1
    assert _alive(stranger), "a pid that is no longer kvproc's was signalled"
    assert f"not signalled: host_tier[0] pid {stranger.pid}" in err, err
    launcher.wait(10)  # the recorded launcher is still itself: it was killed
    assert launcher.returncode == -9
    assert f"SIGKILL to launcher pid {launcher.pid}" in err, err
    assert not os.path.lexists(rd)  # marked, and its launcher is now provably dead


def test_down_force_does_not_signal_a_pid_without_a_recorded_identity(
        tmp_path: pathlib.Path, sleeper: Sleeper, capsys: pytest.CaptureFixture[str]) -> None:
    """A manifest from before identities were recorded: its pids cannot be verified, so none is signalled."""
    launcher, child = sleeper(), sleeper()
    rd = str(tmp_path / "rd")
    _fake_cluster(rd, mf.process_identity(launcher.pid), [(child.pid, None)])
    rc = standalone.down_main(["--runtime-dir", rd, "--timeout", "0.5", "--force"])
    err = capsys.readouterr().err
    assert rc == 1 and _alive(child)
    assert f"not signalled: host_tier[0] pid {child.pid}: cannot verify" in err, err


def test_signal_if_same_checks_identity(sleeper: Sleeper) -> None:
    proc = sleeper()
    ident = mf.process_identity(proc.pid)
    assert ident is not None and mf.process_state(ident) == "running"
    assert mf.signal_if_same(_wrong_start(ident), signal.SIGKILL) == "gone" and _alive(proc)
    assert mf.signal_if_same(None, signal.SIGKILL) == "unknown" and _alive(proc)
    assert mf.signal_if_same(ident, signal.SIGKILL) == "running"
    assert proc.wait(10) == -signal.SIGKILL
    assert mf.process_state(ident) == "gone"  # reaped: the pid is free
