"""The loop-owned `AsyncRpcClient` against real server processes: handshake, calls, typed errors, the deadline
backstop, peer death (SIGKILL under the launcher's supervisor, `mark_dead`, `Goodbye`), backpressure and close."""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

from kvproc.ipc import messages as m
from kvproc.ipc.aclient import AsyncRpcClient
from kvproc.ipc.cancel import new_token
from kvproc.ipc.client import RpcClient
from kvproc.ipc.errors import CallCancelled, HandshakeRefused, PeerDeadError, RemoteError
from kvproc.runtime import RoleConfig, launch
from tests.ipc.conftest import TOKEN, Served, serve_role


@pytest.fixture
def own_server() -> Iterator[Served]:
    """A server process of its own, for tests that stop, kill or shut it down."""
    with tempfile.TemporaryDirectory(prefix="kva-", dir="/tmp") as d:
        s = serve_role(d)
        try:
            yield s
        finally:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(s.proc.pid, sig)
                except ProcessLookupError:
                    pass
            s.proc.join(5)


def _client(s: Served, **kw: Any) -> AsyncRpcClient:
    return AsyncRpcClient(s.endpoint, token=kw.pop("token", TOKEN), peer="host_tier[0]", **kw)


def test_handshake_then_calls_inline_and_through_the_handler_pool(served: Served) -> None:
    async def main() -> None:
        ac = _client(served)
        try:
            first = asyncio.ensure_future(ac.call(m.Ping(b"early")))  # pipelined behind the Hello
            welcome = await ac.connect(5.0)
            assert welcome.pid == served.proc.pid and welcome.role == "host_tier"
            assert ac.server_pid == served.proc.pid
            assert await first == m.Pong(b"early", served.proc.pid)
            echoes = await asyncio.gather(*(ac.call(m.Echo(b"%d" % i), timeout=5) for i in range(50)))
            assert [e.data for e in echoes] == [b"%d" % i for i in range(50)]
            report = await ac.call(m.Stats(), timeout=5)
            assert report.pid == served.proc.pid
            assert ac.pending_count == 0 and ac.alive
        finally:
            ac.close()

    asyncio.run(main())


def test_remote_exception_arrives_typed_with_code(served: Served) -> None:
    async def main() -> None:
        ac = _client(served)
        try:
            with pytest.raises(RemoteError) as err:
                await ac.call(m.Fail("boom", code="debug_code"), timeout=5)
            assert err.value.code == "debug_code" and err.value.exc_type == "HandlerError"
            assert "boom" in err.value.message
            with pytest.raises(RemoteError) as late:  # the server's own deadline check, not the local backstop
                await ac.call(m.Sleep(10.0), timeout=0.2)
            assert late.value.code == "deadline_exceeded" and "local backstop" not in late.value.message
            assert (await ac.call(m.Ping(b"x"), timeout=5)).data == b"x"  # the socket is still fine
        finally:
            ac.close()

    asyncio.run(main())


def test_a_cancel_token_reaches_the_server_and_the_call_ends_cancelled(served: Served) -> None:
    async def main() -> None:
        ac = _client(served)
        try:
            token = new_token()
            task = asyncio.ensure_future(ac.call(m.Sleep(10.0), timeout=10, cancel_token=token))
            await asyncio.sleep(0.2)
            t0 = time.monotonic()
            threading.Thread(target=token.cancel).start()  # a token may be cancelled from any thread
            with pytest.raises(CallCancelled):
                await task
            assert time.monotonic() - t0 < 2.0  # the cancel, not the 10 s deadline
            with pytest.raises(CallCancelled):  # already cancelled: not even sent
                await ac.call(m.Sleep(1.0), cancel_token=token)
        finally:
            ac.close()

    asyncio.run(main())


def test_a_reply_that_never_comes_fails_shortly_after_its_deadline(own_server: Served) -> None:
    async def main() -> None:
        ac = _client(own_server, deadline_grace_s=0.05)
        try:
            await ac.connect(5.0)
            os.kill(own_server.proc.pid, signal.SIGSTOP)  # alive but silent: only the local backstop can end it
            t0 = time.monotonic()
            with pytest.raises(RemoteError) as err:
                await ac.call(m.Echo(b"never"), timeout=0.2)
            elapsed = time.monotonic() - t0
            assert err.value.code == "deadline_exceeded" and "local backstop" in err.value.message
            assert 0.2 <= elapsed < 1.5, elapsed  # the deadline plus the grace, not the server's 10 s or never
            assert ac.pending_count == 0
            # A standalone client's handshake has its own timeout: a silent server is declared dead.
            late = _client(own_server, handshake_timeout_s=0.2)
            with pytest.raises(PeerDeadError, match="no handshake reply"):
                await late.connect()
            late.close()
            os.kill(own_server.proc.pid, signal.SIGCONT)
            # The late reply to the expired call is read and dropped; the next call gets its own reply.
            assert (await ac.call(m.Echo(b"after"), timeout=5)).data == b"after"
            assert ac.alive
        finally:
            ac.close()

    asyncio.run(main())


def test_sigkill_under_the_launcher_fails_every_pending_call_with_peer_dead_at_once() -> None:
    with launch([RoleConfig("host_tier", options={"segment_bytes": 64 * 1024}, restart=False)], cluster_name="ac",
                runtime_dir=f"/tmp/kvac-{os.getpid()}") as cluster:
        sync = cluster.client("host_tier")

        async def main() -> None:
            ac = AsyncRpcClient.for_client(sync)
            try:
                await ac.connect(5.0)
                calls = [asyncio.ensure_future(ac.call(m.Sleep(30.0), timeout=30)) for _ in range(5)]
                await asyncio.sleep(0.2)
                assert ac.pending_count == 5
                t0 = time.monotonic()
                os.kill(cluster.pid("host_tier"), signal.SIGKILL)
                outcomes = await asyncio.gather(*calls, return_exceptions=True)
                # The supervisor sees the child's sentinel and marks the sync client dead; its death listener fails
                # this client's calls (no heartbeat period involved: that would take 3 s).
                assert time.monotonic() - t0 < 2.0
                assert all(isinstance(o, PeerDeadError) for o in outcomes), outcomes
                assert not ac.alive and "SIGKILL" in str(outcomes[0])
                with pytest.raises(PeerDeadError):  # and every later call at once
                    await ac.call(m.Ping(), timeout=5)
            finally:
                ac.close()

        asyncio.run(main())


def test_mark_dead_of_the_followed_client_from_another_thread_fails_pending_calls(served: Served) -> None:
    sync = served.client(heartbeat_s=None)  # dies only when told: by the test

    async def main() -> None:
        ac = AsyncRpcClient.for_client(sync)
        try:
            calls = [asyncio.ensure_future(ac.call(m.Sleep(10.0), timeout=10)) for _ in range(3)]
            await asyncio.sleep(0.2)
            assert sync.pending_count == 3  # the followed client counts the calls in flight on this socket
            t0 = time.monotonic()
            threading.Thread(target=sync.mark_dead, args=("declared dead by the test",)).start()
            outcomes = await asyncio.gather(*calls, return_exceptions=True)
            assert time.monotonic() - t0 < 1.0
            assert [type(o) for o in outcomes] == [PeerDeadError] * 3
            assert str(outcomes[0]) == "declared dead by the test"
            assert sync.pending_count == 0 and ac._sock is None
            # A client made for an already dead one is dead from the start.
            late = AsyncRpcClient.for_client(sync)
            assert not late.alive
            with pytest.raises(PeerDeadError):
                await late.call(m.Ping())
            late.close()
        finally:
            ac.close()

    try:
        asyncio.run(main())
    finally:
        sync.close()


def test_a_real_server_shutting_down_fails_pending_calls_with_peer_dead(own_server: Served) -> None:
    # The server says Goodbye on a 100 ms linger, which a heavily loaded host can miss; the followed client's heartbeats
    # are the backstop then (the scripted test below checks the Goodbye path itself, deterministically).
    sync = own_server.client(heartbeat_s=0.5, liveness=3)

    async def main() -> None:
        ac = AsyncRpcClient.for_client(sync)
        try:
            await ac.connect(5.0)
            sleeping = [asyncio.ensure_future(ac.call(m.Sleep(10.0), timeout=10)) for _ in range(3)]
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            try:  # replies Ok and says Goodbye to every peer; the Goodbye may overtake the Ok
                await ac.call(m.Shutdown("test"), timeout=5)
            except PeerDeadError:
                pass
            outcomes = await asyncio.gather(*sleeping, return_exceptions=True)
            assert time.monotonic() - t0 < 4.0
            assert [type(o) for o in outcomes] == [PeerDeadError] * 3  # no token, 10 s: only the peer's end ends them
            assert all("goodbye" in str(o) or "heartbeat" in str(o) for o in outcomes), outcomes
            assert not ac.alive and not sync.alive  # the whole peer is gone, whichever socket heard it first
        finally:
            ac.close()

    try:
        asyncio.run(main())
    finally:
        sync.close()
    own_server.proc.join(5)
    assert own_server.proc.exitcode == 0


def test_goodbye_with_calls_in_flight_fails_every_one_with_peer_dead() -> None:
    # A scripted ROUTER (a real server's Goodbye rides a 100 ms linger that a loaded host may not honour): it shakes
    # hands, swallows the calls, then says Goodbye.
    import zmq

    with tempfile.TemporaryDirectory(prefix="kva-", dir="/tmp") as d:
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

        sync = RpcClient(endpoint, token=TOKEN, peer="fake[0]", heartbeat_s=None)  # dies only when told
        sync.connect(5.0)

        async def main() -> None:
            ac = AsyncRpcClient.for_client(sync)
            try:
                await ac.connect(5.0)
                calls = [asyncio.ensure_future(ac.call(m.Sleep(10.0), timeout=10)) for _ in range(3)]
                outcomes = await asyncio.wait_for(asyncio.gather(*calls, return_exceptions=True), 5.0)
                assert [type(o) for o in outcomes] == [PeerDeadError] * 3
                assert "said goodbye: scripted" in str(outcomes[0])
                assert not ac.alive and ac.pending_count == 0
                # The Goodbye reached this socket only: it tells the followed client the whole peer is leaving.
                assert not sync.alive and "scripted" in (sync.dead_reason or "")
            finally:
                ac.close()

        try:
            asyncio.run(main())
        finally:
            sync.close()
            server.join(5)
            router.close()


def test_handshake_refused_fails_connect_and_pending_calls(served: Served) -> None:
    async def main() -> None:
        ac = _client(served, token="wrong")
        try:
            got: list[Any] = []
            ac.call_nowait(m.Ping(), on_reply=got.append)  # sent behind the Hello, before any answer
            with pytest.raises(HandshakeRefused) as err:
                await ac.connect(5.0)
            assert err.value.code == "bad_token"
            assert len(got) == 1 and isinstance(got[0], HandshakeRefused)
            assert not ac.alive
            with pytest.raises(PeerDeadError, match="handshake refused"):  # later calls: at once
                await ac.call(m.Ping())
        finally:
            ac.close()

    asyncio.run(main())


def test_fire_and_forget_replies_are_read_and_failures_reported(served: Served) -> None:
    async def main() -> None:
        ac = _client(served)
        got: list[Any] = []
        try:
            for i in range(20):
                ac.call_nowait(m.Echo(b"%d" % i), timeout=5, on_reply=got.append)
            ac.call_nowait(m.Fail("nope"), timeout=5, on_reply=got.append)
            ac.call_nowait(m.Ping())  # no callback: read and dropped
            deadline = time.monotonic() + 5
            while (len(got) < 21 or ac.pending_count) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            assert sum(isinstance(r, m.Ok) for r in got) == 20
            assert [r.code for r in got if isinstance(r, m.Failed)] == ["debug"]
            assert ac.pending_count == 0
        finally:
            ac.close()
        ac.call_nowait(m.Ping(), on_reply=got.append)  # after close: PeerDead, reported, never raised
        assert isinstance(got[-1], m.PeerDead)

    asyncio.run(main())


def test_a_deferred_fire_and_forget_call_is_sent_before_a_later_call(served: Served) -> None:
    async def main() -> None:
        ac = _client(served)
        order: list[str] = []
        try:
            await ac.connect(5.0)
            ac.call_nowait(m.Ping(b"first"), timeout=5, on_reply=lambda r: order.append(r.payload.data.decode()))
            assert ac.pending_count == 1  # deferred, yet pending (its deadline backstop runs)
            # Ping is answered on the server's socket thread in arrival order: the replies show the send order.
            order.append((await ac.call(m.Ping(b"second"), timeout=5)).data.decode())
            assert order == ["first", "second"]
            ac.call_nowait(m.Ping(b"third"), timeout=5, on_reply=lambda r: order.append(r.payload.data.decode()))
            end = time.monotonic() + 5  # sent by its own flush (after the callbacks due), not only by a later send
            while ac.pending_count and time.monotonic() < end:
                await asyncio.sleep(0.01)
            assert order[-1] == "third" and ac.pending_count == 0
            ac.call_nowait(m.Ping(), timeout=5, on_reply=order.append)
        finally:
            ac.close()  # a deferred call still unsent ends with PeerDead like any pending one
        assert isinstance(order[-1], m.PeerDead)

    asyncio.run(main())


def test_the_pending_table_is_bounded(served: Served) -> None:
    async def main() -> None:
        ac = _client(served, max_pending=2)
        try:
            slow = [asyncio.ensure_future(ac.call(m.Sleep(0.3), timeout=5)) for _ in range(2)]
            await asyncio.sleep(0)  # let both tasks send
            assert ac.pending_count == 2
            with pytest.raises(RemoteError) as err:
                await ac.call(m.Ping())
            assert err.value.code == "overloaded"
            await asyncio.gather(*slow)
            assert (await ac.call(m.Ping(b"ok"), timeout=5)).data == b"ok"
        finally:
            ac.close()

    asyncio.run(main())


def test_close_fails_pending_calls_and_leaves_no_socket_to_warn_about(served: Served) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        async def main() -> None:
            ac = _client(served)
            call = asyncio.ensure_future(ac.call(m.Sleep(5.0), timeout=10))
            await asyncio.sleep(0.05)
            ac.close()
            with pytest.raises(PeerDeadError, match="client closed"):
                await call
            # From another thread while the loop runs: handed to the loop.
            other = _client(served)
            await other.connect(5.0)
            pending = asyncio.ensure_future(other.call(m.Sleep(5.0), timeout=10))
            await asyncio.sleep(0.01)
            await asyncio.get_running_loop().run_in_executor(None, other.close)
            with pytest.raises(PeerDeadError):
                await pending

        asyncio.run(main())
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)], [str(w.message) for w in caught]


def test_close_after_the_loop_has_stopped_is_safe() -> None:
    loop = asyncio.new_event_loop()
    holder: list[AsyncRpcClient] = []

    async def make() -> None:
        holder.append(AsyncRpcClient("ipc:///tmp/kvproc-nobody-listens.sock", token=TOKEN, handshake_timeout_s=30))
        asyncio.ensure_future(holder[0].call(m.Ping(), timeout=30))
        await asyncio.sleep(0)

    loop.run_until_complete(make())
    loop.close()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        holder[0].close()  # from this thread, the loop closed: settles and closes the socket here
        holder[0].mark_dead("late")
        del holder[:]
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


def test_the_store_loops_link_follows_a_restarted_peer_and_closes_the_old_socket() -> None:
    # What RemoteCopier does with a restarted copy worker (a host tier stands in: it starts faster, no torch import).
    from kvproc.runtime.loopthread import LoopThread
    from kvproc.tiers.remote import _LoopLink

    role = RoleConfig("host_tier", options={"segment_bytes": 64 * 1024}, restart=True, max_restarts=1)
    with launch([role], cluster_name="acr", runtime_dir=f"/tmp/kvacr-{os.getpid()}") as cluster:
        link = _LoopLink(lambda: cluster.client("host_tier"))
        lt = LoopThread("test-store-loop")

        async def ping() -> tuple[AsyncRpcClient, int]:
            ac = link.get()
            assert ac is not None
            return ac, (await ac.call(m.Ping(), timeout=5)).pid

        try:
            assert link.get() is None  # off the loop: callers use the sync client
            first, pid1 = lt.submit(ping()).result(5)
            assert first.follows is cluster.client("host_tier") and pid1 == cluster.pid("host_tier")
            os.kill(pid1, signal.SIGKILL)
            end = time.monotonic() + 5
            while first.alive and time.monotonic() < end:  # the supervisor's verdict reaches the loop
                time.sleep(0.01)
            assert not first.alive and first._sock is None  # closed when its incarnation died
            cluster.wait_available("host_tier", timeout=15)
            second, pid2 = lt.submit(ping()).result(5)
            assert second is not first and pid2 == cluster.pid("host_tier") != pid1
            assert second.follows is cluster.client("host_tier")
        finally:
            link.close()
            lt.stop()
        assert not second.alive and second._sock is None
