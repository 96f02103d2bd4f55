"""A reply the client cannot decode ends its call at once with `undecodable_reply` (not `deadline_exceeded` at the
deadline), on every client path; and a role whose counters hold a non-int refuses its Stats with `bad_counter`
instead of sending a report nobody can read. Real server and clients over a real ipc:// socket, in one process."""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest

from kvproc.ipc import messages as m
from kvproc.ipc.client import RpcClient
from kvproc.ipc.context import CallContext
from kvproc.ipc.errors import RemoteError
from kvproc.ipc.server import RpcServer
from kvproc.ipc.service import Service, handles
from kvproc.ipc.sockets import ipc_endpoint
from kvproc.runtime.role import Role, RoleEnv
from kvproc.tiers.remote import await_sync_call

TOKEN = "t0ken"
DEADLINE_S = 60.0  # far longer than the test: a call that waited for it would fail the test by pytest's timeout


def _report(counters: dict[str, Any]) -> m.StatsReport:
    return m.StatsReport("bad", 0, 1, 0.0, 0, 1, 0, 0, 0, 0, 0, 0, counters)


class _BadReply(Service):
    """Answers Stats with a report whose counter is a float: encodable, not decodable as the wire's int."""

    @handles(m.Stats)
    def stats(self, msg: m.Stats, ctx: CallContext) -> m.StatsReport:
        return _report({"busy_s": 0.25})


@contextlib.contextmanager
def _serving(service: Service) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="kvund-", dir="/tmp") as d:
        endpoint = ipc_endpoint(d, "undecodable")
        srv = RpcServer(service, endpoints=[endpoint], token=TOKEN, role="undecodable", workers=2)
        srv.bind()
        thread = srv.start()
        try:
            yield endpoint
        finally:
            srv.stop()
            thread.join(10)


@pytest.fixture
def client() -> Iterator[RpcClient]:
    with _serving(_BadReply()) as endpoint:
        c = RpcClient(endpoint, token=TOKEN, peer="undecodable[0]")
        c.connect(10.0)
        try:
            yield c
        finally:
            c.close()


@pytest.mark.timeout(30)
def test_the_calling_threads_own_socket_ends_the_call_with_undecodable_reply(client: RpcClient) -> None:
    with pytest.raises(RemoteError) as err:
        client.request(m.Stats(), timeout=DEADLINE_S)
    assert err.value.code == "undecodable_reply" and "undecodable[0]" in err.value.message
    assert client.frame_errors >= 1
    assert client.request(m.Ping(b"x"), timeout=10).data == b"x"  # the connection goes on


@pytest.mark.timeout(30)
def test_the_io_threads_path_ends_the_call_with_undecodable_reply(client: RpcClient) -> None:
    reply = client.call(m.Stats(), timeout=DEADLINE_S).result(DEADLINE_S)
    assert isinstance(reply, m.Failed) and reply.code == "undecodable_reply"


@pytest.mark.timeout(30)
def test_a_call_awaited_on_an_event_loop_ends_with_undecodable_reply(client: RpcClient) -> None:
    async def go() -> None:  # the store loop's path: `RemoteTier` / `RemoteCopier` await every call this way
        await await_sync_call(client, m.Stats(), DEADLINE_S)

    with pytest.raises(RemoteError) as err:
        asyncio.run(go())
    assert err.value.code == "undecodable_reply"


@pytest.mark.timeout(30)
def test_a_role_with_a_non_int_counter_refuses_its_stats_by_name() -> None:
    role = Role(RoleEnv("c", "host_tier", 3, "/tmp"))
    role.counters.set("kv_events.busy_s", 0.5)  # type: ignore[arg-type]  # the bug this guards against
    role.counters.set("flag", True)
    role.counters.inc("fine")
    with _serving(role) as endpoint:
        c = RpcClient(endpoint, token=TOKEN, peer="host_tier[3]")
        c.connect(10.0)
        try:
            with pytest.raises(RemoteError) as err:
                c.request(m.Stats(), timeout=DEADLINE_S)
        finally:
            c.close()
    assert err.value.code == "bad_counter"
    assert "kv_events.busy_s=0.5" in err.value.message and "flag=True" in err.value.message
    assert "fine" not in err.value.message
