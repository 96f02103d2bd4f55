"""What the ipc tests share: a host-tier role served by a forkserver child over real sockets, and its token."""

from __future__ import annotations

import multiprocessing
import os
import signal
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from kvproc.ipc import messages as m
from kvproc.ipc.client import RpcClient
from kvproc.ipc.sockets import ipc_endpoint
from kvproc.runtime.child import ChildSpec, child_main

TOKEN = "t0ken"


class Served:
    def __init__(self, proc: Any, endpoint: str, runtime_dir: str) -> None:
        self.proc, self.endpoint, self.runtime_dir = proc, endpoint, runtime_dir

    def client(self, **kw: Any) -> RpcClient:
        c = RpcClient(self.endpoint, token=kw.pop("token", TOKEN), peer="host_tier[0]", **kw)
        c.connect(5.0)
        return c


def serve_role(runtime_dir: str, **options: Any) -> Served:
    ctx = multiprocessing.get_context("forkserver")
    endpoint = ipc_endpoint(runtime_dir, "host_tier-0")
    spec = ChildSpec(
        "rpctest",
        "host_tier",
        0,
        "kvproc.runtime.roles:HostTierRole",
        runtime_dir,
        (endpoint,),
        TOKEN,
        os.getpid(),
        options,
        max_frame_bytes=64 * 1024,
    )
    r, w = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=child_main, args=(spec, w), daemon=True)
    proc.start()
    w.close()
    assert r.poll(20.0), "child did not report ready"
    assert type(m.startup_decoder().decode(r.recv_bytes())) is m.Ready
    return Served(proc, endpoint, runtime_dir)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    """A host-tier role in a forkserver child, shared by a test module's tests (killed at the module's end)."""
    with tempfile.TemporaryDirectory(prefix="kvt-", dir="/tmp") as d:
        s = serve_role(d)
        try:
            yield s
        finally:
            if s.proc.is_alive():
                os.kill(s.proc.pid, signal.SIGKILL)
            s.proc.join(5)
