"""The entry point of every child process: set up, build the role and its server, report ready, serve.

Order matters: the process title, faulthandler and logging come first so that even a failed start is diagnosable;
the ready report (`Ready` on the start-up pipe) is sent only after the server is bound, so a launcher that got it
can connect at once; a failure before that is reported as `StartupFailed` with the traceback.
The process ends with `os._exit` so that a handler thread stuck in a call cannot hold the exit hostage.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import structlog

from kvproc.ipc import messages as m
from kvproc.ipc.server import RpcServer
from kvproc.runtime import procutil
from kvproc.runtime.parent_death import Note, ParentWatch
from kvproc.runtime.logs import configure_logging
from kvproc.runtime.role import RoleEnv
from kvproc.runtime.roles import resolve_role_class

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class ChildSpec:
    cluster: str
    role: str
    rank: int
    role_class: str  # "module:Class"
    runtime_dir: str
    endpoints: tuple[str, ...]
    token: str
    launcher_pid: int
    options: dict[str, Any] = field(default_factory=dict)
    workers: int = 4
    max_in_flight: int = 256
    max_frame_bytes: int = 1 << 20
    log_level: str = "info"
    cpus: tuple[int, ...] = ()  # pinned to these CPUs (procutil.pin_cpus) before any thread starts; () = not pinned


def child_main(spec: ChildSpec, ready: Connection) -> None:
    code = 1
    try:
        code = _run(spec, ready)
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _run(spec: ChildSpec, ready: Connection) -> int:
    procutil.set_title(f"kvproc:{spec.cluster}:{spec.role}:{spec.rank}")
    if spec.cpus:  # first: every thread started from here on (watchers, ZeroMQ's I/O thread, handlers) inherits it
        procutil.pin_cpus(spec.cpus)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole group; the launcher orders the stop
    faulthandler.enable()
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` dumps every thread's stack
    configure_logging(spec.role, spec.rank, level=spec.log_level)

    stop_early = False
    server: RpcServer | None = None

    def request_stop(*_: Any) -> None:
        nonlocal stop_early
        stop_early = True
        if server is not None:
            server.stop()

    # Opened before any thread starts: the launcher's death is reported on it without waiting (parent_death.py).
    watch = ParentWatch(spec.launcher_pid, Note(spec.role, spec.rank))

    def on_sigterm(*_: Any) -> None:
        # The launcher's SIGTERM asks for an orderly stop; the same signal from PR_SET_PDEATHSIG (the forkserver
        # followed a dead launcher out) takes the lock-free exit instead: nobody is left to stop us in order.
        if watch.launcher_gone():
            watch.die("launcher_died")
        request_stop()

    signal.signal(signal.SIGTERM, on_sigterm)
    watch.arm()
    role = None
    try:
        cls = resolve_role_class(spec.role_class)
        env = RoleEnv(spec.cluster, spec.role, spec.rank, spec.runtime_dir, spec.options, request_stop)
        role = cls(env)
        server = RpcServer(
            role,
            endpoints=spec.endpoints,
            token=spec.token,
            role=spec.role,
            rank=spec.rank,
            workers=spec.workers,
            max_in_flight=spec.max_in_flight,
            max_frame_bytes=spec.max_frame_bytes,
        )
        role.server = server
        bound = server.bind()
    except BaseException:
        log.exception("child_start_failed")
        ready.send_bytes(m.encode(m.StartupFailed(traceback.format_exc())))
        if role is not None:
            role.on_stop()
        return 1
    ready.send_bytes(m.encode(m.Ready(os.getpid(), bound, [s.name for s in role.segments], dict(role.published))))
    ready.close()
    log.info("child_ready", endpoints=bound, role_class=spec.role_class, cpus=list(spec.cpus) or None)
    if stop_early:
        server.stop()
    server.serve()  # returns after stop(); its exit path runs role.on_stop() (segments unlinked)
    log.info("child_exit")
    return 0
