"""`launch(...)`: start a cluster's child processes, supervise them, and shut them down in order.

Start: children are forked by a `multiprocessing` forkserver whose preload list holds the kvproc runtime and the
roles' modules, plus torch only when a configured role declares `needs_torch` -- a forked child then starts in
tens of milliseconds instead of paying the ~2 s torch import. (The forkserver is process-wide; its preload list is
fixed by the first launch in a process.) All children start in parallel; each must send `Ready` on its start-up pipe
and answer the handshake before one shared deadline, or `launch` stops the others and raises `ClusterStartError`
naming the child that did not come up and why.

Supervision: the `Supervisor` thread sees a child exit through its sentinel at once; the launcher then fails every
pending call to it with PeerDead (`RpcClient.mark_dead`), unlinks the dead child's segments, records the crash and
either restarts it (restartable roles, e.g. copy workers, up to `max_restarts` within any `restart_window_s`) or
marks it unavailable, so callers fail fast with PeerDead and the store degrades instead of hanging.

Shutdown (`Cluster.shutdown(deadline_s)`), against one deadline: a `Shutdown` message to every child (reverse start
order), then SIGTERM to those still alive at 60% of the deadline, then SIGKILL at 90%; then segments are swept and
the runtime directory removed (only if it carries kvproc's marker and this launcher owns it: see `manifest`). A
`weakref.finalize` backstop kills leftover children if the owner never shuts down.

Every pid in the manifest comes with the process's identity (its start time), recorded at launch, so that
`kvproc down --force` never signals a process that merely reuses a kvproc pid.
"""

from __future__ import annotations

import collections
import functools
import os
import signal
import threading
import time
import weakref
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Mapping, Sequence

import structlog

from kvproc.ipc import messages as m
from kvproc.ipc.client import RpcClient
from kvproc.ipc.errors import IpcError
from kvproc.ipc.segment import sweep_dead_segments
from kvproc.ipc.sockets import ipc_endpoint
from kvproc.runtime import manifest as mf
from kvproc.runtime import procutil
from kvproc.runtime.child import ChildSpec, child_main
from kvproc.runtime.config import ClusterStartError, PeerEvent, RoleConfig
from kvproc.runtime.control import start_control_server
from kvproc.runtime.forking import forkserver_context, own_mp_temp_dir, parent_main_hidden
from kvproc.runtime.janitor import Janitor, JanitorSpec, start_janitor
from kvproc.runtime.roles import resolve_role_class
from kvproc.runtime.supervisor import PROCESS_LOCK, ChildHandle, Supervisor, describe_exit

log = structlog.get_logger(__name__)


def _kill_leftovers(
    children: dict[tuple[str, int], ChildHandle], runtime_dir: str, owner: mf.ProcessIdentity | None,
    janitor: list[Janitor], torn_down: threading.Event,
) -> None:
    # weakref.finalize backstop: holds only the child table, a path, an identity and the janitor's pipe, never the
    # Cluster itself. `torn_down` first: the supervisor (a daemon thread, still running at interpreter exit) then
    # reports the kills as exits, not as crashes to restart into a removed runtime dir.
    torn_down.set()
    for j in janitor:
        j.stop()
    for child in list(children.values()):
        if not child.exited.is_set():
            try:
                os.kill(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    mf.remove_runtime_dir(runtime_dir, owner)


class Cluster:
    def __init__(self, name: str, runtime_dir: str, token: str, configs: Sequence[RoleConfig]) -> None:
        self.name = name
        self.runtime_dir = runtime_dir
        self.token = token
        self.manifest_path = os.path.join(runtime_dir, "manifest.json")
        self.events: list[PeerEvent] = []
        self.created_at = time.time()
        self._configs = {(c.role, c.rank): c for c in configs}
        self._order = [(c.role, c.rank) for c in configs]
        self._children: dict[tuple[str, int], ChildHandle] = {}
        self._state: dict[tuple[str, int], str] = {}
        self._restarts: dict[tuple[str, int], int] = {k: 0 for k in self._order}  # lifetime count (stats)
        self._restart_times: dict[tuple[str, int], collections.deque[float]] = {k: collections.deque()
                                                                                 for k in self._order}
        self._replacing: set[tuple[str, int]] = set()
        self._all_pids: set[int] = set()
        self.identity = mf.process_identity(os.getpid())  # the launcher's, in the manifest and the dir's marker
        self._identities: dict[int, mf.ProcessIdentity | None] = {}  # pid -> identity, recorded at start
        self.runtime_dir_removal: mf.DirRemoval | None = None  # what shutdown did to the runtime dir
        self._cond = threading.Condition()
        self._restart_lock = threading.Lock()
        self._stopping = False
        self._done = threading.Event()
        # Before the forkserver starts (it puts its socket in the process's multiprocessing temp dir): a dir made
        # here is this launcher's, and its janitor removes it if the launcher is killed.
        self._mp_temp_dir = own_mp_temp_dir()
        self._mp = forkserver_context(configs)
        self._supervisor = Supervisor(self._on_exit)
        self._control: Any = None
        self.control_endpoint = ""
        self.metrics: Any = None  # a MetricsEndpoint when launched with `metrics=` (its `.address`)
        self.published: dict[str, str] = {}  # this process's own endpoints (device KV events), for the manifest
        # Counters of what the launcher's process embeds (the store), shown by `kvproc console status` with the
        # launcher's own: each provider returns a flat {name: int}.
        self.counter_providers: list[Callable[[], Mapping[str, int]]] = []
        # Called with (role, rank) once a child that stopped answering answers again (`_reconnect`): its new client
        # is in place. The store sends what the stall kept back (`RemoteTier.reconnected`).
        self.reconnect_listeners: list[Callable[[str, int], None]] = []
        # The janitor (`janitor.py`) sweeps what this cluster leaves if its launcher is killed; a list so that the
        # finalizer can see one started after it was made.
        self._janitor: list[Janitor] = []
        self._torn_down = threading.Event()  # set by the backstop: the children are being killed, the dir removed
        self._finalizer = weakref.finalize(self, _kill_leftovers, self._children, runtime_dir, self.identity,
                                           self._janitor, self._torn_down)

    # ---- public API ----

    def _halted(self) -> bool:
        """Shutting down, or torn down by the backstop: no restart, no manifest rewrite."""
        return self._stopping or self._torn_down.is_set()

    def client(self, role: str, rank: int = 0) -> RpcClient:
        """The current incarnation's client. After a crash it is dead (calls fail with PeerDead at once) until a
        restart replaces it: fetch it again rather than keeping it."""
        child = self._children[(role, rank)]
        assert child.client is not None
        return child.client

    @property
    def members(self) -> list[tuple[str, int]]:
        """Every (role, rank) of the cluster, in start order."""
        return list(self._order)

    def restarts(self, role: str, rank: int = 0) -> int:
        """How many times the launcher restarted this role (its lifetime count)."""
        return self._restarts[(role, rank)]

    def available(self, role: str, rank: int = 0) -> bool:
        child = self._children.get((role, rank))
        return self._state.get((role, rank)) == "up" and child is not None and bool(child.client and child.client.alive)

    def state(self, role: str, rank: int = 0) -> str:
        with self._cond:  # a state is visible only once the manifest says it too (see _set_state)
            return self._state[(role, rank)]

    def pid(self, role: str, rank: int = 0) -> int:
        return self._children[(role, rank)].pid

    def wait_available(self, role: str, rank: int = 0, timeout: float = 10.0) -> RpcClient:
        """Block until the role is up (e.g. after an automatic restart); raises TimeoutError."""
        end = time.monotonic() + timeout
        with self._cond:
            while not self.available(role, rank):
                if self._state.get((role, rank)) == "unavailable":
                    raise ClusterStartError(f"{role}[{rank}] is unavailable (restart failed or not allowed)")
                left = end - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{role}[{rank}] not available after {timeout:.1f}s ({self._state})")
                self._cond.wait(left)
        return self.client(role, rank)

    def restart(self, role: str, rank: int = 0, timeout: float = 15.0) -> RpcClient:
        """Replace the child (stopping it first if alive) and return the new incarnation's client."""
        return self._restart((role, rank), timeout, explicit=True)

    def shutdown(self, deadline_s: float = 5.0, *, stop_janitor: bool = True) -> None:
        """Stop every child against one deadline and remove what they leave. `stop_janitor=False` keeps the janitor
        watching: an owner with segments of its own to unlink after this (`ClusterStore`) stops it after those."""
        with self._cond:
            if self._stopping:
                already = True
            else:
                already, self._stopping = False, True
        if already:
            self._done.wait(deadline_s + 5.0)
            return
        end = time.monotonic() + deadline_s
        have_lock = self._restart_lock.acquire(timeout=deadline_s / 2)  # let a restart in progress finish
        try:
            live = [self._children[k] for k in reversed(self._order) if not self._children[k].exited.is_set()]
            for c in live:
                if c.client is not None and c.client.alive:
                    c.client.call(m.Shutdown("cluster shutdown"), deadline=end)
            self._wait_exited(live, end - 0.4 * deadline_s)
            self._signal(live, signal.SIGTERM, "sigterm_after_shutdown_message")
            self._wait_exited(live, end - 0.1 * deadline_s)
            self._signal(live, signal.SIGKILL, "sigkill_after_sigterm")
            self._wait_exited(live, end + 2.0)
        finally:
            if have_lock:
                self._restart_lock.release()
        for c in self._children.values():
            if c.client is not None:
                c.client.close()
        if self._control is not None:
            self._control.stop()
        if self.metrics is not None:
            self.metrics.close()
        self._supervisor.stop()
        sweep_dead_segments(pids=self._all_pids)
        self.runtime_dir_removal = mf.remove_runtime_dir(self.runtime_dir, self.identity)
        log.info("runtime_dir_removed" if self.runtime_dir_removal.done else "runtime_dir_kept",
                 detail=self.runtime_dir_removal.message)
        self._finalizer.detach()
        with self._cond:
            for k in self._order:
                self._state[k] = "stopped"
            self._cond.notify_all()
        log.info("cluster_down", cluster=self.name)
        if stop_janitor:
            self.stop_janitor()
        self._done.set()

    def stop_janitor(self) -> None:
        """Everything of this cluster is gone: the janitor has nothing to watch for any more."""
        while self._janitor:
            self._janitor.pop().stop()

    def _start_janitor(self, timeout: float) -> None:
        spec = JanitorSpec(self.name, os.getpid(), self.runtime_dir, self.identity, mp_temp_dir=self._mp_temp_dir)
        try:
            self._janitor.append(start_janitor(self._mp, spec, timeout))
        except Exception as e:  # noqa: BLE001 - never fail a start over it: the next start's sweep remains
            log.warning("janitor_not_started", cluster=self.name, error=repr(e))

    @property
    def stopped(self) -> threading.Event:
        return self._done

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- starting ----

    def _spec(self, cfg: RoleConfig) -> ChildSpec:
        endpoints = [ipc_endpoint(self.runtime_dir, f"{cfg.role}-{cfg.rank}")]
        if cfg.tcp:
            endpoints.append(cfg.tcp)
        return ChildSpec(
            self.name, cfg.role, cfg.rank, cfg.class_path, self.runtime_dir, tuple(endpoints), self.token,
            os.getpid(), dict(cfg.options), cfg.workers, cfg.max_in_flight, cfg.max_frame_bytes,
            log_level=cfg.log_level, cpus=cfg.cpus or (),
        )  # fmt: skip

    def _start_child(self, cfg: RoleConfig) -> tuple[ChildHandle, Connection]:
        r, w = self._mp.Pipe(duplex=False)
        proc = self._mp.Process(
            target=child_main, args=(self._spec(cfg), w), name=f"kvproc-{cfg.role}-{cfg.rank}", daemon=True
        )
        with PROCESS_LOCK, parent_main_hidden():
            proc.start()
        w.close()
        assert proc.pid is not None
        self._all_pids.add(proc.pid)
        self._identities[proc.pid] = mf.process_identity(proc.pid)  # before anything could reap it and reuse the pid
        return ChildHandle(cfg.role, cfg.rank, proc, proc.pid, time.time()), r

    def _await_ready(self, child: ChildHandle, conn: Connection, deadline: float, limit_s: float) -> None:
        """Wait until `deadline` for the child's ready report; `limit_s` is the ready timeout it is held to (the
        error names it: the time left of a deadline shared by every child is 0 when the wait fails)."""
        timeout = max(0.0, deadline - time.monotonic())
        try:
            ready = wait([conn, child.process.sentinel], timeout)
            msg: Any = None
            if conn in ready:
                try:
                    msg = m.startup_decoder().decode(conn.recv_bytes())
                except EOFError:
                    msg = None
            if isinstance(msg, m.StartupFailed):
                raise ClusterStartError(f"{child.label} failed to start:\n{msg.error}")
            if msg is None:
                if child.process.sentinel in ready:
                    with PROCESS_LOCK:
                        code = child.process.exitcode
                    raise ClusterStartError(f"{child.label} exited ({describe_exit(code)}) before it was ready")
                raise ClusterStartError(f"{child.label} did not come up within {limit_s:g}s, the ready timeout (no "
                                        "ready report)")
        finally:
            conn.close()
        child.endpoints, child.segments, child.published = list(msg.endpoints), list(msg.segments), dict(msg.published)
        client = RpcClient(child.endpoints[0], token=self.token, name=f"launcher-{os.getpid()}", peer=child.label)
        try:
            client.connect(max(0.5, deadline - time.monotonic()))
        except IpcError as e:
            raise ClusterStartError(f"{child.label} reported ready but did not answer the handshake: {e}") from e
        child.client = client
        client.add_death_listener(functools.partial(self._on_client_dead, child))

    def _start_all(self, ready_timeout_s: float) -> None:
        deadline = time.monotonic() + ready_timeout_s
        started = []
        try:
            self._start_janitor(ready_timeout_s)  # first: a launcher killed while its children start is covered
            for key in self._order:
                child, conn = self._start_child(self._configs[key])
                self._children[key] = child
                started.append((child, conn))
            for child, conn in started:
                self._await_ready(child, conn, deadline, ready_timeout_s)
        except BaseException:
            for child, conn in started:
                conn.close()
                if child.client is not None:
                    child.client.close()
            self._signal([c for c, _ in started], signal.SIGKILL, "kill_after_failed_start")
            for child, _ in started:
                child.process.join(5.0)
            sweep_dead_segments(pids=self._all_pids)
            self.stop_janitor()
            raise
        for key in self._order:
            self._state[key] = "up"
            self._supervisor.watch(self._children[key])

    def _restart(self, key: tuple[str, int], timeout: float, explicit: bool) -> RpcClient:
        with self._restart_lock:
            if self._halted():
                raise ClusterStartError(f"{key[0]}[{key[1]}]: cluster is shutting down")
            old = self._children[key]
            if explicit and not old.exited.is_set():
                self._replacing.add(key)
                if old.client is not None:
                    old.client.call(m.Shutdown("restart"), timeout=2.0)
                if not old.exited.wait(2.0):
                    self._signal([old], signal.SIGKILL, "sigkill_for_restart")
                    old.exited.wait(5.0)
            self._set_state(key, "restarting")
            child, conn = self._start_child(self._configs[key])
            try:
                self._await_ready(child, conn, time.monotonic() + timeout, timeout)
            except ClusterStartError as e:
                self._signal([child], signal.SIGKILL, "kill_after_failed_restart")
                self._children[key] = child  # so its exit is observed (and ignored: state is unavailable)
                self._supervisor.watch(child)
                self._record(key, child.pid, "unavailable", str(e))
                self._set_state(key, "unavailable")
                raise
            finally:
                self._replacing.discard(key)
            self._children[key] = child
            self._restarts[key] += 1
            self._restart_times[key].append(time.monotonic())
            self._supervisor.watch(child)
            self._record(key, child.pid, "restarted", f"restart {self._restarts[key]}")
            self._set_state(key, "up")
            assert child.client is not None
            return child.client

    # ---- supervision (supervisor thread) ----

    def _on_exit(self, child: ChildHandle) -> None:
        key = (child.role, child.rank)
        reason = f"{child.label} {describe_exit(child.exitcode)}"
        if child.client is not None:
            child.client.mark_dead(reason)  # every pending call fails with PeerDead now
        removed = sweep_dead_segments(pids=[child.pid])
        if self._halted() or key in self._replacing or self._children.get(key) is not child:
            log.info("child_exited", child=child.label, status=describe_exit(child.exitcode))
            return
        if self._state.get(key) == "unavailable":
            return
        log.error("child_died", child=child.label, status=describe_exit(child.exitcode), swept=removed)
        self._record(key, child.pid, "crashed", reason)
        cfg = self._configs[key]
        restart = cfg.restart if cfg.restart is not None else resolve_role_class(cfg.class_path).restartable
        if restart and self._restarts_in_window(key, cfg.restart_window_s) < cfg.max_restarts:
            self._set_state(key, "restarting")
            threading.Thread(target=self._auto_restart, args=(key,), name="kvproc-restart", daemon=True).start()
        else:
            self._record(key, child.pid, "unavailable", "not restartable" if not restart else "too many restarts")
            self._set_state(key, "unavailable")

    def _restarts_in_window(self, key: tuple[str, int], window_s: float) -> int:
        """Restarts of `key` within the last `window_s` (older ones no longer count against the budget)."""
        times, since = self._restart_times[key], time.monotonic() - window_s
        while times and times[0] < since:
            times.popleft()
        return len(times)

    def _on_client_dead(self, child: ChildHandle, reason: str) -> None:
        """The child's client was declared dead. An exit is the supervisor's (restart or unavailable); a live child
        declared dead -- it stopped answering heartbeats for a while: stopped, starved, swapping -- is reconnected
        once it answers again, on a thread of its own (this runs on the client's I/O thread)."""
        if self._halted() or child.exited.is_set():
            return
        threading.Thread(target=self._reconnect, args=(child, reason), name="kvproc-reconnect", daemon=True).start()

    def _reconnect(self, child: ChildHandle, reason: str) -> None:
        key = (child.role, child.rank)
        # Let an exit that caused the death (the sentinel may be a moment behind the socket) be seen first.
        if child.exited.wait(0.2) or self._halted() or key in self._replacing or self._children.get(key) is not child:
            return
        log.warning("child_unresponsive", child=child.label, reason=reason)
        self._record(key, child.pid, "unresponsive", reason)
        self._set_state(key, "unresponsive")
        while not (self._halted() or child.exited.is_set() or key in self._replacing
                   or self._children.get(key) is not child):
            client = RpcClient(child.endpoints[0], token=self.token, name=f"launcher-{os.getpid()}", peer=child.label)
            try:
                client.connect(1.0)
            except IpcError:
                client.close()
                time.sleep(0.5)
                continue
            with self._restart_lock:  # a restart must not interleave with the swap
                if self._halted() or child.exited.is_set() or self._children.get(key) is not child:
                    client.close()
                    return
                old, child.client = child.client, client
                client.add_death_listener(functools.partial(self._on_client_dead, child))
                self._record(key, child.pid, "reconnected", f"answering again after: {reason}")
                self._set_state(key, "up")
            log.info("child_reconnected", child=child.label)
            if old is not None:
                old.close()
            for listener in list(self.reconnect_listeners):
                try:
                    listener(*key)
                except Exception:  # noqa: BLE001 - one listener's bug must not stop the others
                    log.exception("reconnect_listener_failed", child=child.label)
            return

    def _auto_restart(self, key: tuple[str, int]) -> None:
        try:
            self._restart(key, 15.0, explicit=False)
        except Exception as e:
            log.error("restart_failed", role=key[0], rank=key[1], error=str(e))

    # ---- helpers ----

    def _record(self, key: tuple[str, int], pid: int, what: str, detail: str) -> None:
        self.events.append(PeerEvent(key[0], key[1], pid, what, detail, time.time()))

    def publish(self, endpoints: Mapping[str, str]) -> None:
        """Name endpoints this process serves (e.g. device-pool KV events) in the manifest (`Manifest.published`)."""
        with self._cond:  # the lock every manifest rewrite takes: a concurrent state change keeps them
            self.published.update(endpoints)
            if not self._halted():
                self.write_manifest()

    def _set_state(self, key: tuple[str, int], state: str) -> None:
        # The manifest is rewritten under the same lock, so whoever sees the new state (console, tests) also finds
        # it in the manifest.
        with self._cond:
            self._state[key] = state
            if not self._halted():
                self.write_manifest()
            self._cond.notify_all()

    @staticmethod
    def _wait_exited(children: Sequence[ChildHandle], until: float) -> None:
        for c in children:
            c.exited.wait(max(0.0, until - time.monotonic()))

    @staticmethod
    def _signal(children: Sequence[ChildHandle], sig: int, event: str) -> None:
        for c in children:
            if not c.exited.is_set():
                log.warning(event, child=c.label)
                try:
                    os.kill(c.pid, sig)
                except ProcessLookupError:
                    pass

    def write_manifest(self) -> str:
        procs = [
            mf.ProcessEntry(
                role=c.role,
                rank=c.rank,
                pid=c.pid,
                endpoint=c.endpoints[0] if c.endpoints else "",
                tcp=c.endpoints[1] if len(c.endpoints) > 1 else "",
                state=self._state.get(k, "starting"),
                started_at=c.started_at,
                restarts=self._restarts[k],
                exitcode=c.exitcode,
                segments=c.segments,
                identity=self._identities.get(c.pid),
                published=c.published,
            )  # fmt: skip
            for k in self._order
            if (c := self._children.get(k)) is not None
        ]
        manifest = mf.Manifest(
            mf.MANIFEST_VERSION, self.name, self.runtime_dir, os.getpid(), self.created_at, self.control_endpoint, procs,
            launcher_identity=self.identity, metrics=self.metrics.address if self.metrics is not None else "",
            published=dict(self.published),
        )
        return mf.write_manifest(self.runtime_dir, manifest)

    def counters(self) -> dict[str, int]:
        out = {
            "children_up": sum(1 for k in self._order if self.available(*k)),
            "children": len(self._order),
            "restarts": sum(self._restarts.values()),
            "crashes": sum(1 for e in self.events if e.what == "crashed"),
        }
        for provider in list(self.counter_providers):
            try:
                out.update(provider())
            except Exception as e:  # noqa: BLE001 - a broken provider must not break the console
                log.warning("counter_provider_failed", error=repr(e))
        return out


def launch(
    roles: Sequence[RoleConfig],
    *,
    cluster_name: str = "default",
    runtime_dir: str | None = None,
    ready_timeout_s: float = 60.0,
    control: bool = True,
    metrics: str | None = None,
) -> Cluster:
    """Start every role's process, wait until each is ready and connected, and return the supervised cluster.

    Use as a context manager (`with launch([...]) as cluster:`) or call `cluster.shutdown()` yourself.
    """
    keys = [(c.role, c.rank) for c in roles]
    if len(set(keys)) != len(keys):
        raise ValueError(f"duplicate (role, rank) in {keys}")
    for c in roles:
        if c.cpus is not None:  # refused here, with the role named, rather than as a child that fails to start
            procutil.check_cpus(c.cpus, f"{c.role}[{c.rank}]")
    t0 = time.monotonic()
    mf.check_cluster_name(cluster_name)
    swept = sweep_dead_segments()  # leftovers of any kvproc process that died without cleaning up
    if swept:
        log.warning("swept_dead_segments", segments=swept)
    if runtime_dir is None:  # runtime dirs that crashed launchers left in the default base (only provably dead ones)
        swept_dirs = mf.sweep_stale_runtime_dirs(os.path.dirname(mf.default_runtime_dir(cluster_name)))
        if swept_dirs:
            log.warning("swept_stale_runtime_dirs", dirs=swept_dirs)
    path = mf.prepare_runtime_dir(cluster_name, runtime_dir)
    cluster = Cluster(cluster_name, path, mf.write_token(path), roles)
    try:
        if metrics:  # bound first: a taken port fails here, before any child starts (kvproc/runtime/metrics.py)
            from kvproc.runtime.metrics import MetricsEndpoint

            cluster.metrics = MetricsEndpoint(cluster, metrics)
            log.info("metrics_endpoint", address=cluster.metrics.address)
        cluster._start_all(ready_timeout_s)
        if control:
            cluster._control, cluster.control_endpoint = start_control_server(cluster)
        cluster.write_manifest()
    except BaseException:
        cluster._supervisor.stop()
        if cluster.metrics is not None:
            cluster.metrics.close()
        mf.remove_runtime_dir(path, cluster.identity)
        cluster.stop_janitor()
        cluster._finalizer.detach()
        raise
    log.info("cluster_up", cluster=cluster_name, seconds=round(time.monotonic() - t0, 3), roles=len(roles))
    return cluster
