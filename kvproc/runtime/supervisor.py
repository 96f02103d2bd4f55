"""The supervisor thread: waits on every child's sentinel and reports each exit the moment it happens.

It is the only thread that reads a child's exit status (a forkserver child's sentinel carries the status, and two
readers would race for it), so everyone else learns about exits through `ChildHandle.exited` and the callback.
The thread blocks in one `multiprocessing.connection.wait` over all sentinels plus a wake pipe: no polling.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from typing import Any, Callable

import structlog

from kvproc.ipc.client import RpcClient

log = structlog.get_logger(__name__)

# Serialises process start against exit-status reads: `Process.start()` polls every known child (the stdlib's
# `_cleanup`), which would otherwise race the supervisor for a sentinel's exit status.
PROCESS_LOCK = threading.Lock()


@dataclass
class ChildHandle:
    role: str
    rank: int
    process: BaseProcess
    pid: int
    started_at: float
    endpoints: list[str] = field(default_factory=list)
    segments: list[str] = field(default_factory=list)
    published: dict[str, str] = field(default_factory=dict)  # the child's other endpoints (`Role.published`)
    client: RpcClient | None = None
    exitcode: int | None = None
    exited: threading.Event = field(default_factory=threading.Event)

    @property
    def label(self) -> str:
        return f"{self.role}[{self.rank}] pid {self.pid}"


def describe_exit(code: int | None) -> str:
    if code is None:
        return "unknown status"
    if code < 0:
        import signal

        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


class Supervisor:
    def __init__(self, on_exit: Callable[[ChildHandle], None]) -> None:
        self._on_exit = on_exit
        self._lock = threading.Lock()
        self._watched: dict[int, ChildHandle] = {}
        self._wake_r, self._wake_w = os.pipe()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvproc-supervisor", daemon=True)
        self._thread.start()

    def watch(self, child: ChildHandle) -> None:
        with self._lock:
            self._watched[child.process.sentinel] = child
        os.write(self._wake_w, b"w")

    def stop(self) -> None:
        self._stopping = True
        os.write(self._wake_w, b"s")
        self._thread.join(5.0)
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        while not self._stopping:
            with self._lock:
                fds: list[Any] = [*self._watched, self._wake_r]
            for fd in wait(fds):
                if fd == self._wake_r:
                    os.read(self._wake_r, 4096)
                    continue
                with self._lock:
                    child = self._watched.pop(int(fd))  # type: ignore[arg-type]  # we only wait on int fds
                with PROCESS_LOCK:
                    child.exitcode = child.process.exitcode
                child.exited.set()
                try:
                    self._on_exit(child)
                except Exception:  # the supervisor must outlive a bug in one report
                    log.exception("exit_handler_failed", child=child.label)
