"""`Role`: the base of every kvproc process's service (host tier, copy worker, launcher control).

A role is a `Service` with counters and the runtime's own requests: Stats, Profile, Shutdown, and the debug
requests Sleep and Fail (which the tests use to hold a call open and to raise remotely). Subclasses add
`@handles(...)` methods for their own wire types and may create shared-memory segments, which the role unlinks
when it stops.

To add a role: subclass `Role`, set `name` (and `needs_torch` / `restartable`), and register its import path in
`kvproc.runtime.roles.ROLE_CLASSES` (or pass `RoleConfig(role_class="module:Class")`).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Mapping

import psutil
import structlog

from kvproc.ipc import messages as m
from kvproc.ipc.context import DEFERRED, CallContext, Deferred
from kvproc.ipc.errors import HandlerError
from kvproc.ipc.segment import Segment, SegmentBusyError
from kvproc.ipc.service import Service, handles
from kvproc.runtime import profiler
from kvproc.runtime.counters import Counters

if TYPE_CHECKING:
    from kvproc.ipc.server import RpcServer

log = structlog.get_logger(__name__)


@dataclass
class RoleEnv:
    """What a role knows about where it runs."""

    cluster: str
    role: str
    rank: int
    runtime_dir: str
    options: Mapping[str, Any] = field(default_factory=dict)
    request_stop: Callable[[], None] = lambda: None


class Role(Service):
    name: ClassVar[str] = "role"
    needs_torch: ClassVar[bool] = False  # preload torch in the forkserver that starts this role
    restartable: ClassVar[bool] = False  # the launcher restarts a crashed instance by default

    def __init__(self, env: RoleEnv) -> None:
        self.env = env
        self.counters = Counters()
        self.segments: list[Segment] = []
        # Endpoints the role serves besides its RPC socket, by name (e.g. "kv_events"): set in __init__, they go
        # into the manifest for consoles and routers to find.
        self.published: dict[str, str] = {}
        self.server: RpcServer | None = None
        self._started = time.monotonic()
        self._proc = psutil.Process()
        self._profiling = threading.Lock()

    def create_segment(self, nbytes: int) -> Segment:
        seg = Segment.create(self.env.cluster, self.env.role, nbytes)
        self.segments.append(seg)
        return seg

    # ---- runtime requests ----

    @handles(m.Stats)
    def stats(self, msg: m.Stats, ctx: CallContext) -> m.StatsReport:
        t = self.server.transport_stats() if self.server is not None else {}
        counters = {**self.counters.snapshot(), **{f"ipc.{k}": v for k, v in t.items()}}
        # The wire says int: a float or a bool would make the whole report undecodable for the caller. Refused here
        # with the counters' names, so that the bug shows where it is (a role's code set it), not as a stuck console.
        bad = sorted(k for k, v in counters.items() if type(v) is not int)
        if bad:
            raise HandlerError("bad_counter", f"{self.env.role}[{self.env.rank}]: counters are ints, these are not: "
                               + ", ".join(f"{k}={counters[k]!r}" for k in bad[:8]))
        return m.StatsReport(
            role=self.env.role,
            rank=self.env.rank,
            pid=os.getpid(),
            uptime_s=time.monotonic() - self._started,
            rss_bytes=self._proc.memory_info().rss,
            threads=threading.active_count(),
            in_flight=t.get("in_flight", 0),
            queued=t.get("queued", 0),
            outbox=t.get("outbox", 0),
            msgs_in=t.get("msgs_in", 0),
            msgs_out=t.get("msgs_out", 0),
            errors=t.get("errors", 0),
            counters=counters,
            segments=[s.name for s in self.segments],
        )

    @handles(m.Profile)
    def profile(self, msg: m.Profile, ctx: CallContext) -> m.ProfileReport:
        if not self._profiling.acquire(blocking=False):
            raise HandlerError("busy", "a profile of this process is already running")
        try:
            seconds = max(0.0, min(msg.seconds, ctx.remaining() - 0.5))  # leave time to write and reply
            stacks, samples = profiler.sample(seconds, max(msg.interval_ms, 1.0) / 1000, lambda: ctx.cancelled)
            ctx.check()
            out_dir = os.path.join(self.env.runtime_dir, "profiles")
            os.makedirs(out_dir, mode=0o700, exist_ok=True)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            path = os.path.join(out_dir, f"{self.env.role}-{self.env.rank}-{os.getpid()}-{stamp}.txt")
            title = f"{self.env.cluster} {self.env.role}[{self.env.rank}] pid {os.getpid()}"
            profiler.write_report(path, title, stacks, samples, seconds)
        finally:
            self._profiling.release()
        self.counters.inc("profiles")
        return m.ProfileReport(path, samples)

    @handles(m.Shutdown)
    def shutdown(self, msg: m.Shutdown, ctx: CallContext) -> Deferred:
        log.info("shutdown_requested", reason=msg.reason)
        ctx.ok(m.Done())  # reply first: the socket thread sends it before it acts on the stop
        self.env.request_stop()
        return DEFERRED

    @handles(m.Sleep)
    def sleep(self, msg: m.Sleep, ctx: CallContext) -> m.Done:
        """Debug: hold the call open for `seconds`, observing cancellation and the deadline every `step_s`."""
        self.counters.inc("sleeps")
        end = time.monotonic() + msg.seconds
        while (left := end - time.monotonic()) > 0:
            ctx.sleep(min(max(msg.step_s, 0.001), left))
        return m.Done()

    @handles(m.Echo)
    def echo(self, msg: m.Echo, ctx: CallContext) -> m.Pong:
        """Debug: Ping's twin through a handler thread, so benchmarks and tests can see the pool's hop."""
        return m.Pong(msg.data, os.getpid())

    @handles(m.Fail)
    def fail(self, msg: m.Fail, ctx: CallContext) -> m.Done:
        """Debug: raise remotely, so tests see the typed error path end to end."""
        raise HandlerError(msg.code, msg.message)

    def on_stop(self) -> None:
        for seg in self.segments:
            if seg.owner:
                seg.unlink()
            try:
                seg.close()
            except SegmentBusyError:  # a handler still holds a view: the unmap happens at process exit instead
                log.warning("segment_busy_at_stop", segment=seg.name)
