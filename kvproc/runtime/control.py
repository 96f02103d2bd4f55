"""The launcher's own control endpoint (`launcher.sock`): Stats about the cluster, and Shutdown for `kvproc down`.

It runs in the launcher process on its own socket thread, so the console and `kvproc down` reach a cluster through
its manifest without knowing who launched it (a scheduler process embedding the store, or `kvproc up`).
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any

import structlog

from kvproc.ipc import messages as m
from kvproc.ipc.context import DEFERRED, CallContext, Deferred
from kvproc.ipc.server import RpcServer
from kvproc.ipc.service import handles
from kvproc.ipc.sockets import ipc_endpoint
from kvproc.runtime.role import Role, RoleEnv

if TYPE_CHECKING:
    from kvproc.runtime.launcher import Cluster

log = structlog.get_logger(__name__)


class LauncherRole(Role):
    name = "launcher"

    def __init__(self, env: RoleEnv, cluster: Cluster) -> None:
        super().__init__(env)
        self._cluster = cluster

    @handles(m.Stats)
    def stats(self, msg: m.Stats, ctx: CallContext) -> m.StatsReport:
        for name, value in self._cluster.counters().items():
            self.counters.set(name, value)
        return super().stats(msg, ctx)

    @handles(m.Shutdown)
    def shutdown(self, msg: m.Shutdown, ctx: CallContext) -> Deferred:
        log.info("cluster_shutdown_requested", reason=msg.reason)
        ctx.ok(m.Done())
        # Not on this handler thread: shutting down stops this very server.
        threading.Thread(target=self._cluster.shutdown, name="kvproc-shutdown", daemon=True).start()
        return DEFERRED


def start_control_server(cluster: Cluster) -> tuple[Any, str]:
    env = RoleEnv(cluster.name, "launcher", 0, cluster.runtime_dir)
    role = LauncherRole(env, cluster)
    endpoint = ipc_endpoint(cluster.runtime_dir, "launcher")
    server = RpcServer(role, endpoints=[endpoint], token=cluster.token, role="launcher", workers=2)
    role.server = server
    server.bind()
    env.request_stop = server.stop
    server.start(name=f"kvproc-launcher-io-{os.getpid()}")
    return server, endpoint
