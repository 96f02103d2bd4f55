"""RPC across real processes: a role served in a forkserver child, called over real ipc:// ZeroMQ sockets."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvproc.ipc import messages as m
from kvproc.ipc import server as server_mod
from kvproc.ipc.cancel import new_token
from kvproc.ipc.client import RpcClient
from kvproc.ipc.context import CallContext
from kvproc.ipc.errors import CallCancelled, HandshakeRefused, PeerDeadError, RemoteError
from kvproc.ipc.server import RpcServer
from kvproc.ipc.service import Service, handles
from kvproc.ipc.sockets import ipc_endpoint
from tests.ipc.conftest import TOKEN, Served, serve_role


@pytest.fixture
def client(served: Served) -> Iterator[RpcClient]:
    c = served.client()
    yield c
    c.close()


def test_ping_round_trips_payload_and_names_the_server_pid(client: RpcClient, served: Served) -> None:
    pong = client.request(m.Ping(b"abc"), timeout=5)
    assert pong == m.Pong(b"abc", served.proc.pid)


def test_stats_reports_counters_from_the_server_process(client: RpcClient, served: Served) -> None:
    report = client.request(m.Stats(), timeout=5)
    assert report.pid == served.proc.pid and report.role == "host_tier"
    assert report.msgs_in >= 1 and report.rss_bytes > 0


def test_remote_exception_arrives_typed_with_code(client: RpcClient) -> None:
    with pytest.raises(RemoteError) as err:
        client.request(m.Fail("boom", code="debug_code"), timeout=5)
    assert err.value.code == "debug_code" and err.value.exc_type == "HandlerError" and "boom" in err.value.message


def test_deadline_in_the_message_ends_a_long_call_with_deadline_exceeded(client: RpcClient) -> None:
    t0 = time.monotonic()
    reply = client.call(m.Sleep(10.0), timeout=0.3).result(5)
    assert isinstance(reply, m.Failed) and reply.code == "deadline_exceeded"
    assert time.monotonic() - t0 < 2.0


def test_already_expired_deadline_is_refused_without_running(client: RpcClient) -> None:
    reply = client.call(m.Sleep(1.0), deadline=time.monotonic() - 1).result(5)
    assert isinstance(reply, m.Failed) and reply.code == "deadline_exceeded"


def test_cancel_reaches_a_call_waiting_in_the_server_process(client: RpcClient) -> None:
    token = new_token()
    fut = client.call(m.Sleep(10.0), timeout=10, cancel_token=token)
    time.sleep(0.2)  # let it start sleeping over there
    t0 = time.monotonic()
    token.cancel()
    reply = fut.result(5)
    assert reply == m.Cancelled(reply.call_id, token.id)
    assert time.monotonic() - t0 < 1.0
    with pytest.raises(CallCancelled):
        reply.unwrap()


def test_cancelled_token_short_circuits_new_calls(client: RpcClient) -> None:
    token = new_token()
    token.cancel()
    assert isinstance(client.call(m.Sleep(1.0), cancel_token=token).result(1), m.Cancelled)


def test_many_concurrent_calls_from_threads_each_get_their_own_reply(client: RpcClient) -> None:
    results: list[Any] = []

    def worker(i: int) -> None:
        for j in range(50):
            results.append(client.request(m.Ping(f"{i}-{j}".encode()), timeout=10).data)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(results) == sorted(f"{i}-{j}".encode() for i in range(4) for j in range(50))


def test_handshake_with_wrong_token_is_refused(served: Served) -> None:
    with pytest.raises(HandshakeRefused) as err:
        served.client(token="wrong")
    assert err.value.code == "bad_token"


def test_handshake_with_other_protocol_version_is_refused_naming_both(served: Served) -> None:
    import zmq

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(served.endpoint)
        sock.send(m.encode(m.Hello(m.PROTOCOL_VERSION + 7, TOKEN, "old")))
        assert sock.poll(5000)
        reply = m.client_decoder().decode(sock.recv())
    finally:
        sock.close()
    assert isinstance(reply, m.Refused) and reply.code == "protocol_mismatch"
    assert str(m.PROTOCOL_VERSION + 7) in reply.message and str(m.PROTOCOL_VERSION) in reply.message


def test_sigkill_fails_every_outstanding_call_with_peer_dead() -> None:
    with tempfile.TemporaryDirectory(prefix="kvt-", dir="/tmp") as d:
        s = serve_role(d)
        c = s.client(heartbeat_s=0.1, liveness=3)
        try:
            futs = [c.call(m.Sleep(30.0), timeout=30) for _ in range(5)]
            time.sleep(0.1)
            os.kill(s.proc.pid, signal.SIGKILL)
            t0 = time.monotonic()
            replies = [f.result(5) for f in futs]
            # No supervisor here: detection is by heartbeats (0.1 s x 3); with the launcher it is the sentinel.
            assert time.monotonic() - t0 < 2.0
            assert all(isinstance(r, m.PeerDead) for r in replies)
            with pytest.raises(PeerDeadError):
                c.request(m.Ping(), timeout=1)
        finally:
            c.close()
            s.proc.join(5)


def _hold_the_gil(seconds: float) -> None:
    """Stall every other thread of this process for `seconds`, as a stall of the whole process would (a VM paused, a
    starved host): a busy loop that is never asked to let the GIL go (the switch interval set past its end), so the
    client's I/O thread cannot run until it ends."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(seconds + 60)
    try:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
    finally:
        sys.setswitchinterval(interval)


def test_a_stall_of_the_clients_own_process_does_not_declare_a_live_peer_dead(served: Served) -> None:
    # Heartbeats every 0.5 s, dead after 1.5 s of silence: a stall of this process longer than that made the peer
    # look silent, and the old rule (the silence alone) declared it dead without having asked it over the stall.
    # Now a heartbeat must be out and unanswered for 1 s: one goes out when the stall ends, the live peer answers it.
    c = served.client(heartbeat_s=0.5, liveness=3)
    try:
        assert c.request(m.Ping(b"before"), timeout=5) == m.Pong(b"before", served.proc.pid)
        _hold_the_gil(2.5)
        time.sleep(1.5)  # the I/O thread runs again: a heartbeat out and answered
        assert c.dead_reason is None, c.dead_reason
        assert c.request(m.Ping(b"after"), timeout=5) == m.Pong(b"after", served.proc.pid)
    finally:
        c.close()


def test_a_stall_of_both_sides_after_a_heartbeat_went_out_does_not_declare_the_peer_dead(served: Served) -> None:
    # A paused VM stalls the peer and the asker together, possibly just after a heartbeat went out: its reply comes
    # after the stall, when the asker's loop may already judge. The loop sees its own stall and asks again.
    c = served.client(heartbeat_s=1.0, liveness=3)  # asked after 1 s of silence, dead after 3 s
    try:
        assert c.request(m.Ping(b"before"), timeout=5) == m.Pong(b"before", served.proc.pid)
        os.kill(served.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(1.8)  # a heartbeat is out (sent at 1-1.5 s), unanswered: the peer is stopped
            _hold_the_gil(4.0)  # this process stalls past the liveness window
        finally:
            os.kill(served.proc.pid, signal.SIGCONT)
        time.sleep(2.5)  # asked again after the stall, and answered
        assert c.dead_reason is None, c.dead_reason
        assert c.request(m.Ping(b"after"), timeout=5) == m.Pong(b"after", served.proc.pid)
    finally:
        c.close()


def test_a_blocked_request_wakes_with_peer_dead_when_the_peer_is_declared_dead(served: Served) -> None:
    c = served.client()
    outcome: list[BaseException] = []

    def blocked() -> None:
        try:
            c.request(m.Sleep(10.0), timeout=10)
        except BaseException as e:
            outcome.append(e)

    t = threading.Thread(target=blocked)
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    c.mark_dead("declared dead by the test")
    t.join(5)
    assert time.monotonic() - t0 < 0.5
    assert len(outcome) == 1 and isinstance(outcome[0], PeerDeadError)
    c.close()


def test_asyncio_awaits_a_call_through_wrap_future(client: RpcClient) -> None:
    import asyncio

    async def main() -> Any:
        replies = await asyncio.gather(*(asyncio.wrap_future(client.call(m.Echo(b"%d" % i))) for i in range(20)))
        return [r.unwrap().data for r in replies]

    assert asyncio.run(main()) == [b"%d" % i for i in range(20)]


def test_a_oneways_reply_reaches_its_callback(client: RpcClient) -> None:
    got: list[Any] = []
    done = threading.Event()

    def fresh_thread() -> None:
        client.send_oneway(m.Fail("x", code="io_path"), timeout=5, on_reply=lambda r: (got.append(r), done.set()))

    t = threading.Thread(target=fresh_thread)
    t.start()
    t.join(5)
    assert done.wait(5) and isinstance(got[0], m.Failed) and got[0].code == "io_path"


class _Pooled(Service):
    """Echo through the handler pool: every reply is posted to the socket thread's outbox from another thread."""

    @handles(m.Echo)
    def echo(self, msg: m.Echo, ctx: CallContext) -> m.Pong:
        return m.Pong(msg.data, os.getpid())


def test_pooled_replies_reach_the_caller_while_the_socket_thread_sleeps_in_its_idle_receive(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The socket thread of a server with nothing in flight sleeps in a receive (not watching the outbox waker); a
    pooled handler's reply must still go out at once, whatever the interleaving of the handler finishing and the socket
    thread going back to sleep (the call leaves `_in_flight` and enters the outbox in one step). The idle slice is made
    long here, so a stranded reply would show as a wait of seconds."""
    monkeypatch.setattr(server_mod, "IDLE_SLICE_MS", 3000)
    monkeypatch.setattr(RpcServer, "receive_when_idle", True)
    with tempfile.TemporaryDirectory(prefix="kvt-", dir="/tmp") as d:
        srv = RpcServer(_Pooled(), endpoints=[ipc_endpoint(d, "pooled")], token=TOKEN, role="pooled", workers=2)
        (endpoint,) = srv.bind()
        thread = srv.start()
        c = RpcClient(endpoint, token=TOKEN, peer="pooled[0]")
        try:
            c.connect(5.0)
            slowest = 0.0
            for i in range(200):
                t0 = time.monotonic()
                assert c.request(m.Echo(b"%d" % i), timeout=10).data == b"%d" % i
                slowest = max(slowest, time.monotonic() - t0)
            assert slowest < 1.0  # no reply waited for the end of a 3 s slice
            assert srv.transport_stats()["in_flight"] == 0
        finally:
            c.close()
            srv.stop()
            thread.join(10)
        assert not thread.is_alive()  # stop() is seen at the slice's end


def test_threads_that_ask_at_once_all_get_their_replies(client: RpcClient) -> None:
    """Four threads asking at once through the one I/O thread lose nothing."""
    got: list[bytes] = []
    lock = threading.Lock()

    def ask(i: int) -> None:
        for j in range(20):
            data = client.request(m.Echo(b"%d-%d" % (i, j)), timeout=10).data
            with lock:
                got.append(data)

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(got) == sorted(b"%d-%d" % (i, j) for i in range(4) for j in range(20))


def test_a_reply_that_never_comes_fails_shortly_after_its_deadline() -> None:
    # The local backstop: a peer alive but silent (stopped), heartbeats off so that only the deadline can end the call.
    with tempfile.TemporaryDirectory(prefix="kvt-", dir="/tmp") as d:
        s = serve_role(d)
        c = s.client(heartbeat_s=None, deadline_grace_s=0.05)
        try:
            os.kill(s.proc.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            reply = c.call(m.Echo(b"never"), timeout=0.2).result(10)
            elapsed = time.monotonic() - t0
            assert isinstance(reply, m.Failed) and reply.code == "deadline_exceeded"
            assert "local backstop" in reply.message
            assert 0.2 <= elapsed < 5.0, elapsed  # the deadline plus the grace, not never
            assert c.pending_count == 0
            os.kill(s.proc.pid, signal.SIGCONT)
            # The late reply to the expired call is read and dropped; the next call gets its own reply.
            assert c.request(m.Echo(b"after"), timeout=5).data == b"after" and c.alive
        finally:
            os.kill(s.proc.pid, signal.SIGCONT)
            c.close()
            os.kill(s.proc.pid, signal.SIGKILL)
            s.proc.join(5)


def test_a_servers_goodbye_with_calls_in_flight_fails_every_one_with_peer_dead() -> None:
    # A scripted ROUTER (a real server's Goodbye rides a 100 ms linger that a loaded host may not honour): it shakes
    # hands, swallows three calls awaited on an event loop (the store loop's path), then says Goodbye.
    import asyncio

    import zmq

    from kvproc.tiers.remote import await_sync_call

    with tempfile.TemporaryDirectory(prefix="kvt-", dir="/tmp") as d:
        endpoint = f"ipc://{d}/fake.sock"
        router: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(endpoint)
        decoder = m.server_decoder()

        def fake_server() -> None:
            calls = 0
            while calls < 3:
                ident, data = router.recv_multipart()
                msg = decoder.decode(data)
                if type(msg) is m.Hello:
                    router.send_multipart([ident, m.encode(m.Welcome(m.PROTOCOL_VERSION, "fake", 0, os.getpid()))])
                elif type(msg) is m.Call:
                    calls += 1
            router.send_multipart([ident, m.encode(m.Goodbye("scripted"))])

        server = threading.Thread(target=fake_server, daemon=True)
        server.start()
        c = RpcClient(endpoint, token=TOKEN, peer="fake[0]", heartbeat_s=None)  # dies only when told
        c.connect(5.0)

        async def main() -> list[Any]:
            calls = [await_sync_call(c, m.Sleep(10.0), 10) for _ in range(3)]
            return await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5.0)

        try:
            outcomes = asyncio.run(main())
            assert [type(o) for o in outcomes] == [PeerDeadError] * 3
            assert "said goodbye: scripted" in str(outcomes[0])
            assert not c.alive and c.pending_count == 0
        finally:
            c.close()
            server.join(5)
            router.close()
