"""The runtime directory of a cluster: its manifest, its auth token and its ipc endpoints.

Layout (the directory is mode 0700, so only its user can reach the ipc sockets inside):
    <runtime_dir>/manifest.json   roles, pids, endpoints (KV events and /metrics too), segment names; rewritten
                                  atomically on every change
    <runtime_dir>/token           the auth token (0600), required in every handshake (ipc and tcp alike)
    <runtime_dir>/<role>-<rank>.sock, launcher.sock
    <runtime_dir>/profiles/       reports written by `kvproc console profile`
    <runtime_dir>/.kvproc-runtime the marker: kvproc made (or adopted, empty) this dir, and which launcher owns it
Only a dir with the marker is ever cleared or removed by kvproc (an existing non-empty dir without it is refused),
and pids are recorded with their identity (start time, boot, pid namespace) so that a reused pid is never taken
for a kvproc process: not signalled, not judged alive or dead by its number alone.
Default location: $XDG_RUNTIME_DIR/kvproc/<cluster>, else /tmp/kvproc-<uid>/<cluster> (short: Unix socket paths are
limited to 107 bytes).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import signal
import time
from typing import Iterator, Literal, NamedTuple

import msgspec

MANIFEST_VERSION = 1
RUNTIME_MARKER = ".kvproc-runtime"
MARKER_VERSION = 1
_CLUSTER_RE = re.compile(r"^[A-Za-z0-9_-]{1,40}$")


class ClusterRunningError(RuntimeError):
    """A live launcher already owns this runtime directory."""


class RuntimeDirError(RuntimeError):
    """A directory kvproc will not use: it holds files kvproc did not put there (no marker), or its owner cannot be
    checked from here."""


class ProcessIdentity(msgspec.Struct, frozen=True):
    """Which process a pid was when it was recorded: a pid alone may since belong to an unrelated process."""

    pid: int
    start_ticks: int  # starttime of /proc/<pid>/stat: clock ticks after boot, fixed for the process's whole life
    boot_id: str  # /proc/sys/kernel/random/boot_id: pids and ticks of another boot mean nothing
    pid_ns: int  # inode of the recorder's pid namespace: the pid is a number in that namespace only


ProcessState = Literal["running", "gone", "unknown"]


class RuntimeMarker(msgspec.Struct):
    """Content of `<runtime_dir>/.kvproc-runtime`."""

    version: int
    cluster: str
    created_dir: bool  # False: the dir existed (empty) before kvproc used it; removing it empties it and keeps it
    launcher: ProcessIdentity | None = None


class DirRemoval(NamedTuple):
    done: bool  # kvproc removed (or emptied) the dir
    message: str  # what happened, in words, with the path


class ProcessEntry(msgspec.Struct):
    role: str
    rank: int
    pid: int
    endpoint: str
    tcp: str = ""
    state: str = "up"  # up | restarting | unavailable | stopped
    started_at: float = 0.0  # unix time, for uptime
    restarts: int = 0
    exitcode: int | None = None
    segments: list[str] = []
    identity: ProcessIdentity | None = None  # recorded at launch; `kvproc down --force` signals only this process
    # Other endpoints the process serves, by name: "kv_events" (PUB) and "kv_events_replay" (ROUTER) of a host tier
    # started with KV events (`tiers/kv_events.py`)
    published: dict[str, str] = {}


class Manifest(msgspec.Struct):
    version: int
    cluster: str
    runtime_dir: str
    launcher_pid: int
    created_at: float
    control_endpoint: str = ""
    processes: list[ProcessEntry] = []
    launcher_identity: ProcessIdentity | None = None
    metrics: str = ""  # HOST:PORT of the cluster's Prometheus /metrics, "" when off (`runtime/metrics.py`)
    # Endpoints the launcher's own process (the engine's) serves, by name: each rank's device-pool KV events,
    # "kv_events_device_<rank>" (PUB) and "kv_events_device_replay_<rank>" (ROUTER), when started with KV events
    published: dict[str, str] = {}


def check_cluster_name(name: str) -> None:
    if not _CLUSTER_RE.match(name):
        raise ValueError(f"cluster name {name!r} must be 1-40 characters of [A-Za-z0-9_-]")


def default_runtime_dir(cluster: str) -> str:
    check_cluster_name(cluster)
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    base = os.path.join(xdg, "kvproc") if xdg else f"/tmp/kvproc-{os.getuid()}"
    return os.path.join(base, cluster)


def _make_private_dir(path: str) -> None:
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to us: refusing to use it")
    os.chmod(path, 0o700)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_ns() -> int:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def _stat_fields(pid: int) -> list[str] | None:
    """Fields 3.. of /proc/<pid>/stat (state, ppid, ...), read after the command name, which may hold spaces and
    parentheses; None if there is no such process (or it cannot be read)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2 :].decode("ascii", "replace").split()


def process_identity(pid: int) -> ProcessIdentity | None:
    """The identity of process `pid` as it is now, or None if there is no such process (or no procfs to read)."""
    fields = _stat_fields(pid)
    boot_id = _boot_id()
    if fields is None or len(fields) < 20 or not boot_id:
        return None
    return ProcessIdentity(pid, int(fields[19]), boot_id, _pid_ns())


def process_state(recorded: ProcessIdentity | None) -> ProcessState:
    """Is the recorded process still running?

    "running": the same pid with the same start time, in this boot; "gone": provably not (its pid is free or a
    zombie, belongs to a process started at another time, or the machine has rebooted since); "unknown": no
    identity was recorded, or it was recorded in another pid namespace, where its pid is another number."""
    boot_id = _boot_id()
    if recorded is None or not recorded.boot_id or not boot_id:
        return "unknown"
    if recorded.boot_id != boot_id:
        return "gone"
    if recorded.pid_ns != _pid_ns():
        return "unknown"
    fields = _stat_fields(recorded.pid)
    if fields is None or len(fields) < 20:
        return "unknown" if _alive(recorded.pid) else "gone"
    if int(fields[19]) != recorded.start_ticks or fields[0] in ("Z", "X"):
        return "gone"
    return "running"


def signal_if_same(recorded: ProcessIdentity | None, sig: int) -> ProcessState:
    """Send `sig` to the recorded process only if it is still that process; returns its state ("running": sent).

    The check is made through a pidfd opened before it, so the signal cannot reach a process that took the pid
    between the check and the kill."""
    if recorded is None:
        return "unknown"
    try:
        pidfd = os.pidfd_open(recorded.pid)
    except ProcessLookupError:
        return "gone" if process_state(recorded) != "unknown" else "unknown"
    except OSError:  # no pidfds here: check, then kill (a reuse in between is the only window left)
        state = process_state(recorded)
        if state == "running":
            try:
                os.kill(recorded.pid, sig)
            except ProcessLookupError:
                return "gone"
        return state
    try:
        state = process_state(recorded)  # the pidfd now pins the process the pid named when it was opened
        if state == "running":
            try:
                signal.pidfd_send_signal(pidfd, sig)
            except ProcessLookupError:
                return "gone"
        return state
    finally:
        os.close(pidfd)


def read_marker(runtime_dir: str) -> RuntimeMarker | None:
    """The marker kvproc wrote into `runtime_dir`, or None if there is none (or not one kvproc wrote)."""
    try:
        fd = os.open(os.path.join(runtime_dir, RUNTIME_MARKER), os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        data = f.read(1 << 16)
    try:
        return msgspec.json.decode(data, type=RuntimeMarker)
    except msgspec.DecodeError:
        return None


def write_marker(runtime_dir: str, marker: RuntimeMarker) -> None:
    path = os.path.join(runtime_dir, RUNTIME_MARKER)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.encode(marker))
    os.replace(tmp, path)  # readers see the old marker or the new one, never half of one


@contextlib.contextmanager
def _dir_lock(path: str) -> Iterator[bool]:
    """An exclusive flock on directory `path`, taken by every kvproc process before it clears, reclaims or removes
    it; yields False if `path` is no longer the directory that was locked (removed meanwhile) or none at all."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        yield False
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        yield same
    finally:
        os.close(fd)  # releases the lock


def _clear_entries(path: str) -> None:
    """Remove everything in `path` except its marker (callers checked the marker)."""
    for name in os.listdir(path):
        if name == RUNTIME_MARKER:
            continue
        entry = os.path.join(path, name)
        if os.path.isdir(entry) and not os.path.islink(entry):
            shutil.rmtree(entry, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry)


def _check_owner(path: str) -> None:
    st = os.stat(path)
    if st.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {st.st_uid}, not to us: refusing to use it")


def _owner_words(marker: RuntimeMarker) -> str:
    pid = marker.launcher.pid if marker.launcher is not None else "?"
    return f"cluster {marker.cluster!r} (launcher pid {pid})"


def prepare_runtime_dir(cluster: str, runtime_dir: str | None = None) -> str:
    """Create the cluster's runtime dir (or adopt an empty one, or reclaim one whose launcher is provably dead),
    mark it as this launcher's and return its path.

    Refused: a non-empty dir without kvproc's marker (RuntimeDirError: kvproc never deletes files it did not put
    there), and a marked dir whose launcher is still running (ClusterRunningError) or cannot be checked from here
    (RuntimeDirError)."""
    path = os.path.abspath(runtime_dir or default_runtime_dir(cluster))
    if runtime_dir is None:
        _make_private_dir(os.path.dirname(path))  # the per-user base dir must be ours and private too
    me = process_identity(os.getpid())
    for _ in range(3):  # a sweep may remove a dead launcher's dir between our look and our lock: look again
        if _prepare_once(path, cluster, me):
            return path
    raise RuntimeDirError(f"runtime dir {path} kept being removed while kvproc was preparing it; try again")


def _prepare_once(path: str, cluster: str, me: ProcessIdentity | None) -> bool:
    if os.path.lexists(path) and not os.path.isdir(path):
        raise RuntimeDirError(f"runtime dir {path} exists and is not a directory: refusing to use it")
    created = False
    if not os.path.isdir(path):
        try:
            os.makedirs(path, mode=0o700)
            created = True
        except FileExistsError:  # made meanwhile by someone else: judged below like any existing dir
            pass
    with _dir_lock(path) as ok:
        if not ok:
            return False
        _check_owner(path)
        marker = read_marker(path)
        if marker is None:
            if os.listdir(path):
                raise RuntimeDirError(
                    f"refusing runtime dir {path}: it is not empty and has no {RUNTIME_MARKER} marker, so kvproc "
                    "did not create it (kvproc only clears or removes directories it marked); pass a new or empty "
                    "directory, or remove this one yourself"
                )
        else:
            launcher = marker.launcher
            ours = launcher is not None and launcher == me  # this process relaunching into its own dir
            state = process_state(launcher)
            if state == "running" and not ours:
                raise ClusterRunningError(
                    f"{_owner_words(marker)} is already running in {path}; "
                    "stop it with `kvproc down` or pick another cluster name"
                )
            if state == "unknown":
                raise RuntimeDirError(
                    f"runtime dir {path} belongs to {_owner_words(marker)}, which cannot be checked from here (no "
                    "identity recorded, or recorded in another pid namespace); if it is stopped, remove the dir "
                    "yourself"
                )
            created = marker.created_dir
            _clear_entries(path)  # stale leftovers of a dead launcher: sockets, manifest, token
        os.chmod(path, 0o700)
        write_marker(path, RuntimeMarker(MARKER_VERSION, cluster, created, me))
    return True


def remove_runtime_dir(runtime_dir: str, owner: ProcessIdentity | None = None) -> DirRemoval:
    """Remove a runtime dir kvproc marked: one whose launcher is `owner` (a cluster removing its own dir) or, with
    `owner` None, one whose launcher is provably dead (leftovers of a crash). A dir kvproc adopted (it existed,
    empty) is emptied and kept. An unmarked dir is never touched. Says what it did."""
    path = os.path.abspath(runtime_dir)
    with _dir_lock(path) as ok:
        if not ok:
            return DirRemoval(False, f"runtime dir {path} is already gone")
        marker = read_marker(path)
        if marker is None:
            return DirRemoval(False, f"kept runtime dir {path}: it has no {RUNTIME_MARKER} marker, so kvproc did "
                                     "not create it")
        if owner is not None:
            if marker.launcher != owner:
                return DirRemoval(False, f"kept runtime dir {path}: it now belongs to {_owner_words(marker)}")
        else:
            state = process_state(marker.launcher)
            if state != "gone":
                why = "is still running" if state == "running" else "cannot be proved dead from here"
                return DirRemoval(False, f"kept runtime dir {path}: {_owner_words(marker)} {why}")
        _clear_entries(path)
        os.unlink(os.path.join(path, RUNTIME_MARKER))
        if not marker.created_dir:
            return DirRemoval(True, f"emptied runtime dir {path} (kept the directory: it existed before kvproc)")
        try:
            os.rmdir(path)
        except OSError as e:  # something was added meanwhile: leave it
            return DirRemoval(True, f"emptied runtime dir {path} but could not remove it: {e}")
        return DirRemoval(True, f"removed runtime dir {path}")


def sweep_stale_runtime_dirs(base: str) -> list[str]:
    """Remove the marked runtime dirs under `base` whose launchers are provably dead (crashed without cleaning up);
    returns what was done to each. Dirs without a marker, or with a live or uncheckable launcher, are kept."""
    try:
        names = sorted(os.listdir(base))
    except OSError:
        return []
    done = []
    for name in names:
        path = os.path.join(base, name)
        marker = read_marker(path)
        if marker is None or process_state(marker.launcher) != "gone":
            continue
        removal = remove_runtime_dir(path)
        if removal.done:
            done.append(removal.message)
    return done


def write_token(runtime_dir: str) -> str:
    token = secrets.token_hex(16)
    fd = os.open(os.path.join(runtime_dir, "token"), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token)
    return token


def read_token(runtime_dir: str) -> str:
    with open(os.path.join(runtime_dir, "token")) as f:
        return f.read().strip()


def write_manifest(runtime_dir: str, manifest: Manifest) -> str:
    path = os.path.join(runtime_dir, "manifest.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(manifest)))
    os.replace(tmp, path)  # readers see the old or the new manifest, never half of one
    return path


def read_manifest(runtime_dir: str) -> Manifest:
    with open(os.path.join(runtime_dir, "manifest.json"), "rb") as f:
        return msgspec.json.decode(f.read(), type=Manifest)


def find_runtime_dir(cluster: str = "default", runtime_dir: str | None = None) -> str:
    path = runtime_dir or default_runtime_dir(cluster)
    if not os.path.exists(os.path.join(path, "manifest.json")):
        raise FileNotFoundError(f"no running cluster {cluster!r}: {path}/manifest.json does not exist")
    return path


def now() -> float:
    return time.time()
