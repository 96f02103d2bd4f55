"""The runtime directory of a cluster: its manifest, its auth token and its ipc endpoints.

Layout (the directory is mode 0700, so only its user can reach the ipc sockets inside):
    <runtime_dir>/manifest.json   roles, pids, endpoints, segment names; rewritten atomically on every change
    <runtime_dir>/token           the auth token (0600), required in every handshake (ipc and tcp alike)
    <runtime_dir>/<role>-<rank>.sock, launcher.sock
    <runtime_dir>/profiles/       reports written by `kvproc console profile`
Default location: $XDG_RUNTIME_DIR/kvproc/<cluster>, else /tmp/kvproc-<uid>/<cluster> (short: Unix socket paths are
limited to 107 bytes).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import time

import msgspec

MANIFEST_VERSION = 1
_CLUSTER_RE = re.compile(r"^[A-Za-z0-9_-]{1,40}$")


class ClusterRunningError(RuntimeError):
    """A live launcher already owns this runtime directory."""


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


class Manifest(msgspec.Struct):
    version: int
    cluster: str
    runtime_dir: str
    launcher_pid: int
    created_at: float
    control_endpoint: str = ""
    processes: list[ProcessEntry] = []


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


def prepare_runtime_dir(cluster: str, runtime_dir: str | None = None) -> str:
    """Create (or reclaim from a dead launcher) the cluster's runtime dir; refuse if a live launcher owns it."""
    path = os.path.abspath(runtime_dir or default_runtime_dir(cluster))
    if runtime_dir is None:
        _make_private_dir(os.path.dirname(path))  # the per-user base dir must be ours and private too
    if os.path.exists(os.path.join(path, "manifest.json")):
        old = read_manifest(path)
        if _alive(old.launcher_pid) and old.launcher_pid != os.getpid():
            raise ClusterRunningError(
                f"cluster {old.cluster!r} is already running (launcher pid {old.launcher_pid}, {path}); "
                "stop it with `kvproc down` or pick another cluster name"
            )
    if os.path.isdir(path):
        shutil.rmtree(path)  # stale leftovers of a dead launcher: sockets, manifest, token
    _make_private_dir(path)
    return path


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
