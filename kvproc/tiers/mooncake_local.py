"""A Mooncake Store on loopback for tests and benchmarks: one `mooncake_master` and one storage node
(`mooncake_client`), on free ports, started and stopped by the caller (never a process it did not start).

    with LocalMooncake.start(segment_mb=256) as mc:
        url = mc.url  # mooncake://127.0.0.1:P1?metadata=http://127.0.0.1:P2/metadata
        mc.kill_storage(); mc.start_storage()  # faults: either process can be killed and started again

Every Mooncake process gets `MC_TCP_BIND_ADDRESS=127.0.0.1` (else it binds the machine's first interface). The
master's metrics/admin server gets a free port too (its default, 9003, would collide with a second master).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import structlog

log = structlog.get_logger("kvproc.mooncake_local")

HOST = "127.0.0.1"


class MooncakeUnavailable(RuntimeError):
    """The Mooncake package (`pip install 'kvproc[remote]'`) or its native dependency (libibverbs) is missing."""


def binaries() -> tuple[str, str]:
    """(mooncake_master, mooncake_client): the native executables inside the installed `mooncake` package."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        raise MooncakeUnavailable("the mooncake package is not installed: pip install 'kvproc[remote]'")
    root = Path(next(iter(spec.submodule_search_locations)))
    master, client = root / "mooncake_master", root / "mooncake_client"
    if not (master.exists() and client.exists()):
        raise MooncakeUnavailable(f"no mooncake_master / mooncake_client in {root}")
    return str(master), str(client)


def unavailable_reason() -> str:
    """'' when a Mooncake Store can run here, else why not (for a test's skip)."""
    try:
        binaries()
        import mooncake.store  # noqa: F401 - links libibverbs: fails without the apt package
    except (MooncakeUnavailable, ImportError, OSError) as e:
        return f"Mooncake unavailable: {e}"
    return ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.2)
        return s.connect_ex((HOST, port)) == 0


class LocalMooncake:
    def __init__(self, segment_mb: int, log_dir: str, lease_ttl_ms: int = 0) -> None:
        self.segment_mb = segment_mb
        self.lease_ttl_ms = lease_ttl_ms  # the master's --default_kv_lease_ttl (0: its default, 10 s)
        self.log_dir = log_dir
        self.rpc_port, self.meta_port, self.metrics_port, self.node_port = (free_port() for _ in range(4))
        self.master: subprocess.Popen[bytes] | None = None
        self.storage: subprocess.Popen[bytes] | None = None
        self._env = dict(os.environ, MC_TCP_BIND_ADDRESS=HOST)
        self._master_bin, self._client_bin = binaries()
        self._starts = 0
        self._own_logs = False
        self._log_of: dict[int, str] = {}  # pid -> its log file

    @classmethod
    def start(cls, segment_mb: int = 256, *, log_dir: str | None = None, timeout_s: float = 30.0,
              lease_ttl_ms: int = 0, attempts: int = 2) -> LocalMooncake:
        """Both processes, up and listening. A start that fails (a process exits, or does not listen within
        `timeout_s`) is retried from scratch on fresh ports, up to `attempts` starts in all: once, a storage node
        did not listen within 30 s on a CI machine loaded by a parallel install, and nothing of its log was kept. The
        error names each failed start, with its log's last lines."""
        errors: list[str] = []
        for attempt in range(1, attempts + 1):
            mc = cls(segment_mb, log_dir or tempfile.mkdtemp(prefix="kvproc-mooncake-"), lease_ttl_ms)
            mc._own_logs = log_dir is None  # a temporary log folder goes with `stop`
            try:
                mc.start_master(timeout_s)
                mc.start_storage(timeout_s)
                return mc
            except (TimeoutError, RuntimeError) as e:
                mc.stop()
                errors.append(f"start {attempt}: {e}")
                log.warning("mooncake_local_start_failed", attempt=attempt, attempts=attempts, error=str(e))
            except BaseException:
                mc.stop()
                raise
        raise TimeoutError("a local Mooncake Store did not start:\n" + "\n".join(errors))

    @property
    def master_address(self) -> str:
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://{HOST}:{self.meta_port}/metadata"

    @property
    def url(self) -> str:
        """What `kvproc up --remote` and `ClusterStore.start(remote=)` take."""
        return f"mooncake://{self.master_address}?metadata={self.metadata}"

    def _spawn(self, args: list[str], what: str) -> subprocess.Popen[bytes]:
        self._starts += 1
        path = os.path.join(self.log_dir, f"{what}.{self._starts}.log")
        out = open(path, "wb")
        try:
            proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, env=self._env, start_new_session=True)
        finally:
            out.close()
        self._log_of[proc.pid] = path
        return proc

    def _log_tail(self, proc: subprocess.Popen[bytes], lines: int = 12) -> str:
        """The last lines of `proc`'s log, for an error (a temporary log folder is gone once it is raised)."""
        try:
            with open(self._log_of[proc.pid], "rb") as f:
                tail = f.read().decode(errors="replace").splitlines()[-lines:]
        except (KeyError, OSError) as e:
            return f"(no log: {e})"
        return "\n".join(["  | " + t for t in tail]) or "  | (empty log)"

    def _wait(self, proc: subprocess.Popen[bytes], port: int, what: str, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while not _listening(port):
            if proc.poll() is not None:
                raise RuntimeError(f"{what} exited with {proc.returncode}; its log's end:\n{self._log_tail(proc)}")
            if time.monotonic() > end:
                raise TimeoutError(f"{what} not listening on {port} after {timeout_s}s; its log's end:\n"
                                   f"{self._log_tail(proc)}")
            time.sleep(0.05)

    def start_master(self, timeout_s: float = 30.0) -> None:
        self.master = self._spawn([
            self._master_bin, f"--rpc_address={HOST}", f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true", f"--http_metadata_server_host={HOST}",
            f"--http_metadata_server_port={self.meta_port}", f"--metrics_host={HOST}",
            f"--metrics_port={self.metrics_port}", "--enable_metric_reporting=false",
            *([f"--default_kv_lease_ttl={self.lease_ttl_ms}"] if self.lease_ttl_ms else [])], "master")
        self._wait(self.master, self.rpc_port, "mooncake_master", timeout_s)
        self._wait(self.master, self.meta_port, "mooncake_master (metadata)", timeout_s)

    def start_storage(self, timeout_s: float = 30.0) -> None:
        """The storage node: its service port listens once its segment is mounted at the master."""
        self.storage = self._spawn([
            self._client_bin, f"--host={HOST}", f"--port={self.node_port}",
            f"--global_segment_size={self.segment_mb}MB", "--local_buffer_size=0",
            f"--master_server_address={self.master_address}", f"--metadata_server={self.metadata}",
            "--protocol=tcp"], "storage")
        self._wait(self.storage, self.node_port, "mooncake_client", timeout_s)

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes] | None) -> None:
        if proc is not None and proc.poll() is None:
            proc.kill()
        if proc is not None:
            proc.wait(10)

    def kill_master(self) -> None:
        self._kill(self.master)
        self.master = None

    def kill_storage(self) -> None:
        self._kill(self.storage)
        self.storage = None

    def stop(self) -> None:
        self.kill_storage()
        self.kill_master()
        if self._own_logs:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def restart(self, timeout_s: float = 30.0) -> None:
        """Both processes killed and started again on the same ports (a fresh master: every key is gone)."""
        self.kill_storage()
        self.kill_master()
        self.start_master(timeout_s)
        self.start_storage(timeout_s)

    def __enter__(self) -> LocalMooncake:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
