"""An RPC client owned by one asyncio event loop: its own DEALER, read by the loop itself (no I/O thread).

`RpcClient.call` hands each request to the client's I/O thread and its reply back through a concurrent future and
`call_soon_threadsafe`: two thread wake-ups per call on top of the round trip (20-100 us on a busy 2-core host, where a
Ping awaited on a loop costs 100-150 us). The store's loop awaits two calls per host-hit resolve, so it gets its own
socket:

    ac = AsyncRpcClient.for_client(sync_client)        # on the loop; same endpoint, token and peer name
    payload = await ac.call(m.Query(...), timeout=1.0)  # raises RemoteError / PeerDeadError / CallCancelled
    ac.call_nowait(m.ReleaseLease(lease), on_reply=count_failures)  # fire-and-forget: the reply is still read

Same wire protocol and guarantees as `RpcClient` (`client.py`), whose encoders, decoders and reply types it reuses:
- the handshake (`Hello` with version + token) is pipelined: calls may be sent before the `Welcome`; a `Refused`
  fails every pending call with `HandshakeRefused`, no `Welcome` within `handshake_timeout_s` kills the client;
- every call ends in exactly one outcome: the server's reply; PeerDead when the peer is declared dead (`mark_dead`,
  thread-safe; a followed `RpcClient`'s death, which the launcher's supervisor declares; a `Goodbye` on this socket);
  or a local deadline backstop shortly (`deadline_grace_s`) after the call's deadline;
- bounded: explicit HWMs, LINGER 0, at most `max_pending` calls in flight (beyond: `overloaded`, like a full send
  queue);
- fire-and-forget calls (`call_nowait`) are pending calls like the others (their replies are read, their outcome
  goes to a callback); their send waits for the loop's already-due callbacks, never behind a later send.

Threading: everything but `mark_dead` and `close` runs on the loop's thread, which alone touches the socket. The socket
is read from `loop.add_reader` on ZeroMQ's FD, which is edge-triggered: it signals "the socket's state may have
changed", not "a message is waiting", so every wake-up drains with NOBLOCK until none is left (`ZMQ_EVENTS` says
so without an EAGAIN exception, and re-arms the edge), and every send (which may consume the edge) is followed by a
look at `ZMQ_EVENTS`. Liveness comes from the followed client (its heartbeats or its supervisor); a standalone client
has Goodbye, `mark_dead`, its handshake timeout and the deadline backstop.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import time
from typing import Any, Callable, cast

import msgspec
import structlog
import zmq

from kvproc.ipc import messages as m
from kvproc.ipc.cancel import CancelToken
from kvproc.ipc.client import RpcClient
from kvproc.ipc.errors import HandshakeRefused, PeerDeadError
from kvproc.ipc.sockets import EVENTS, GOODBYE_LINGER_MS, NOBLOCK, POLLIN, configure_socket, new_session
from kvproc.ipc.undecodable import failed_for

log = structlog.get_logger(__name__)
_encode = m.encode
_TERMINAL = m.TERMINAL_TYPES
_POLLIN = POLLIN
_NOBLOCK = NOBLOCK
_Again = zmq.Again

OnReply = Callable[[Any], None]  # receives the terminal reply (Ok / Failed / Cancelled / PeerDead) or an exception


class _Entry:
    __slots__ = ("listener", "sink", "timer", "token")

    def __init__(self, sink: asyncio.Future[Any] | OnReply, timer: asyncio.TimerHandle) -> None:
        self.sink = sink  # the awaited future, or a fire-and-forget callback
        self.timer = timer
        self.token: CancelToken | None = None
        self.listener: Callable[[int], None] | None = None


class AsyncRpcClient:
    def __init__(
        self,
        endpoint: str,
        *,
        token: str,
        name: str = "client",
        peer: str = "",
        context: zmq.Context[Any] | None = None,
        hwm: int = 10_000,
        max_pending: int = 10_000,
        default_timeout_s: float = 30.0,
        deadline_grace_s: float = 0.1,
        handshake_timeout_s: float | None = 5.0,
        defer_oneway: bool = True,
    ) -> None:
        """Open the socket and send `Hello`; call on the owning loop's thread (the loop must be running)."""
        self.endpoint = endpoint
        self.peer = peer or endpoint
        self.name = name
        self.default_timeout_s = default_timeout_s
        self.max_pending = max_pending
        self._grace = deadline_grace_s
        self._loop = asyncio.get_running_loop()
        self._thread_id = threading.get_ident()
        self._ids = itertools.count(1)  # 0 is reserved for frame errors that carry no call id
        self._session = new_session()  # this socket's session id: its every message carries it (`messages.py`)
        self._pending: dict[int, _Entry] = {}
        self._dead: str | None = None
        self._closed = False
        self._outbox: list[tuple[int, bytes]] = []  # deferred fire-and-forget calls (call_nowait), in order
        self.defer_oneway = defer_oneway
        self._die_lock = threading.RLock()  # _die runs off the loop only once it has stopped, maybe on two threads
        self._decoder = m.client_decoder()
        self._welcome: asyncio.Future[m.Welcome] = self._loop.create_future()
        self._unfollow: Callable[[], None] | None = None
        self.follows: RpcClient | None = None  # the sync client whose death is ours (for_client)
        self.server_pid = 0
        self.msgs_in = 0
        self.msgs_out = 0
        self.frame_errors = 0
        self.last_frame_error = ""
        sock: zmq.Socket[bytes] = (context or zmq.Context.instance()).socket(zmq.DEALER)
        configure_socket(sock, hwm=hwm)
        try:
            sock.connect(endpoint)
            self._fd = sock.fileno()  # ZMQ_FD
            self._loop.add_reader(self._fd, self._drain)
        except BaseException:
            sock.close(linger=0)
            raise
        self._sock: zmq.Socket[bytes] | None = sock
        self._hs_timer: asyncio.TimerHandle | None = None
        if handshake_timeout_s is not None:
            self._hs_timer = self._loop.call_later(handshake_timeout_s, self._handshake_timeout, handshake_timeout_s)
        self._send(_encode(m.Hello(m.PROTOCOL_VERSION, token, f"{name}@{os.getpid()}", self._session)))

    @classmethod
    def for_client(cls, client: RpcClient, **kw: Any) -> "AsyncRpcClient":
        """A loop-owned client to `client`'s server (same endpoint, token, names, context, HWM, grace) that dies
        with it: `client.mark_dead` (the launcher's supervisor, heartbeats, `close`) fails this one's calls at once.
        Its `pending_count` includes this one's calls. No handshake timeout by default: `client` already shook hands
        with this incarnation, so a slow `Welcome` means a slow peer, whose liveness is `client`'s to judge (each
        call still has its deadline backstop)."""
        kw.setdefault("handshake_timeout_s", None)
        kw.setdefault("name", f"{client.name}/async")
        kw.setdefault("peer", client.peer)
        kw.setdefault("context", client._ctx)
        kw.setdefault("hwm", client._hwm)
        kw.setdefault("deadline_grace_s", client._grace)
        kw.setdefault("default_timeout_s", client.default_timeout_s)
        ac = cls(client.endpoint, token=client._token, **kw)
        ac.follows = client
        uncount = client.add_pending_source(lambda: len(ac._pending))  # its pending_count counts these calls
        unlisten = client.add_death_listener(ac.mark_dead)  # at once if it is dead already

        def unfollow() -> None:
            unlisten()
            uncount()

        ac._unfollow = unfollow
        return ac

    # ---- state ----

    @property
    def alive(self) -> bool:
        return self._dead is None

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    @property
    def pending_count(self) -> int:
        return len(self._pending)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def on_owner_thread(self) -> bool:
        return threading.get_ident() == self._thread_id

    async def connect(self, timeout: float | None = None) -> m.Welcome:
        """Wait for the handshake's outcome: the `Welcome`, or HandshakeRefused / PeerDeadError. Optional: calls made
        before it are queued behind the `Hello` on the same socket."""
        if timeout is None:
            return await asyncio.shield(self._welcome)
        try:
            return await asyncio.wait_for(asyncio.shield(self._welcome), timeout)
        except asyncio.TimeoutError:
            raise PeerDeadError(f"{self.peer}: no handshake reply from {self.endpoint} within {timeout:.1f}s") from None

    # ---- calling (the loop's thread) ----

    async def call(
        self,
        msg: m.RequestBody,
        *,
        timeout: float | None = None,
        deadline: float | None = None,
        cancel_token: CancelToken | None = None,
    ) -> Any:
        """Send `msg` and await the payload; raises what `reply.unwrap()` raises (RemoteError, PeerDeadError,
        CallCancelled), or HandshakeRefused. `deadline` is absolute `time.monotonic()` seconds, `timeout` relative.
        Cancelling the awaiting task only stops the wait: the call still ends in one reply, which is dropped."""
        fut = self._loop.create_future()
        self._start(msg, timeout, deadline, cancel_token, fut)
        reply = await fut
        return reply.unwrap()

    async def call_keeping_late(self, msg: m.RequestBody, on_late: OnReply, *, timeout: float) -> Any:
        """`call`, except that a reply arriving after the awaiting task was cancelled (its caller stopped waiting)
        goes to `on_late` instead of being dropped: for answers that hold something, e.g. a Hit's lease."""
        fut: asyncio.Future[Any] = self._loop.create_future()

        def deliver(reply: Any) -> None:
            if fut.done():  # nobody is waiting any more
                on_late(reply)
            elif isinstance(reply, BaseException):
                fut.set_exception(reply)
            else:
                fut.set_result(reply)

        self._start(msg, timeout, None, None, deliver)
        reply = await fut
        return reply.unwrap()

    def call_nowait(self, msg: m.RequestBody, *, timeout: float | None = None, deadline: float | None = None,
                    on_reply: OnReply | None = None) -> None:
        """Fire-and-forget: send `msg`; its reply is still read, handed to `on_reply` (the terminal reply struct, or
        an exception such as HandshakeRefused) on the loop, then dropped. Never raises for the call's outcome (a dead
        peer or a full queue reach `on_reply` as PeerDead / Failed).

        With `defer_oneway` (the default) the send waits for the callbacks already due on the loop (`call_later(0)`):
        a resolve that releases its lease as its last step hands its result to the caller first, and the send (which
        on a busy host can cost a context switch) happens after. Program order on the socket is kept: any later send
        (a call, a cancel) first flushes what was deferred."""
        self._start(msg, timeout, deadline, None, on_reply or _drop, defer=self.defer_oneway)

    def _start(self, msg: m.RequestBody, timeout: float | None, deadline: float | None, token: CancelToken | None,
               sink: asyncio.Future[Any] | OnReply, defer: bool = False) -> None:
        call_id = next(self._ids)
        if self._dead is not None:
            _settle(sink, m.PeerDead(call_id, self._dead))
            return
        if token is not None and token.cancelled:
            _settle(sink, m.Cancelled(call_id, token.id))
            return
        if len(self._pending) >= self.max_pending:
            _settle(sink, m.Failed(call_id, "overloaded", "Backpressure", f"{self.max_pending} calls pending"))
            return
        now = time.monotonic()
        if deadline is None:
            deadline = now + (self.default_timeout_s if timeout is None else timeout)
        data = _encode(m.Call(call_id, int(deadline * 1e9), msg, token.id if token is not None else 0, self._session))
        entry = _Entry(sink, self._loop.call_later(max(0.0, deadline - now) + self._grace, self._expire, call_id))
        self._pending[call_id] = entry
        if defer:
            if not self._outbox:
                self._loop.call_later(0, self._flush)  # after the callbacks already due (e.g. a caller's result)
            self._outbox.append((call_id, data))
            return
        if self._outbox:
            self._flush()  # what was deferred goes first: one socket, program order
        if not self._send(data):
            self._complete(call_id, m.Failed(call_id, "overloaded", "Backpressure", "send queue full"))
            return
        if token is not None:
            loop = self._loop

            def listener(token_id: int) -> None:  # any thread: the token's cancel() runs its listeners there
                try:
                    loop.call_soon_threadsafe(self._send_cancel, token_id)
                except RuntimeError:  # the loop is closed: nobody is waiting any more
                    pass

            if token.add_listener(listener):
                entry.token, entry.listener = token, listener
            else:
                self._send_cancel(token.id)  # cancelled between the check above and now

    def _send_cancel(self, token_id: int) -> None:
        if self._sock is not None:
            if self._outbox:
                self._flush()
            self._send(_encode(m.Cancel(token_id, self._session)))

    def _flush(self) -> None:
        """Send the deferred fire-and-forget calls (those that did not end meanwhile), in order."""
        outbox, self._outbox = self._outbox, []
        for call_id, data in outbox:
            if call_id in self._pending and not self._send(data):
                self._complete(call_id, m.Failed(call_id, "overloaded", "Backpressure", "send queue full"))

    def _send(self, data: bytes) -> bool:
        """Send one frame without blocking; False at the high-water mark. A send may consume the FD's edge, so look
        at the socket's events after it and drain if a reply is already waiting."""
        sock = self._sock
        if sock is None:
            return False
        try:
            sock.send(data, _NOBLOCK)
        except _Again:
            return False
        except zmq.ZMQError as e:
            self._die(f"{self.peer}: send failed: {e}")
            return False
        self.msgs_out += 1
        if cast(int, sock.getsockopt(EVENTS)) & _POLLIN:
            self._loop.call_soon(self._drain)
        return True

    # ---- replies (the loop's thread) ----

    def _drain(self) -> None:
        sock = self._sock
        if sock is None:
            return
        decoder = self._decoder
        for _ in range(512):  # bounded batch: let other callbacks run during a flood, then come back
            # ZMQ_EVENTS both answers "is a message waiting" and re-arms the FD's edge; cheaper than a recv that
            # ends in zmq.Again (an exception object per wake-up).
            try:
                if not cast(int, sock.getsockopt(EVENTS)) & _POLLIN:
                    return
                data = sock.recv(_NOBLOCK)
            except _Again:
                return
            except zmq.ZMQError as e:
                self._die(f"{self.peer}: receive failed: {e}")
                return
            self.msgs_in += 1
            try:
                msg = decoder.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self.frame_errors += 1
                self.last_frame_error = str(e)[:200]
                log.warning("bad_frame_from_server", peer=self.peer, detail=self.last_frame_error)
                failed = failed_for(data, e, self.peer)
                if failed is not None:
                    self._complete(failed.call_id, failed)
                continue
            kind = type(msg)
            if kind in _TERMINAL:
                if msg.call_id:
                    self._complete(msg.call_id, msg)
                else:  # the server could not read one of our frames
                    self.frame_errors += 1
                    self.last_frame_error = f"{msg.code}: {msg.message}"
                    log.warning("server_rejected_frame", peer=self.peer, code=msg.code, detail=msg.message)
            elif kind is m.Goodbye:
                reason = f"{self.peer}: said goodbye: {msg.reason}"
                self._die(reason)
                if self.follows is not None:
                    self.follows.mark_dead(reason)  # the whole peer is leaving, as RpcClient's I/O thread concludes
                return
            elif kind is m.Welcome:
                if self._hs_timer is not None:
                    self._hs_timer.cancel()
                self.server_pid = msg.pid
                if not self._welcome.done():
                    self._welcome.set_result(msg)
            elif kind is m.Refused:
                self._die(f"{self.peer}: handshake refused: [{msg.code}] {msg.message}",
                          HandshakeRefused(msg.code, msg.message))
                return
            if self._sock is None:
                return
        self._loop.call_soon(self._drain)

    def _complete(self, call_id: int, reply: Any) -> None:
        entry = self._pending.pop(call_id, None)
        if entry is None:  # already failed locally (deadline backstop): the late reply is dropped
            return
        entry.timer.cancel()
        if entry.token is not None:
            entry.token.remove_listener(entry.listener)  # type: ignore[arg-type]
        _settle(entry.sink, reply)

    def _expire(self, call_id: int) -> None:
        if call_id in self._pending:
            msg = f"{self.peer}: no reply within the deadline (local backstop)"
            self._complete(call_id, m.Failed(call_id, "deadline_exceeded", "DeadlineExceeded", msg))

    def _handshake_timeout(self, seconds: float) -> None:
        if not self._welcome.done():
            self._die(f"{self.peer}: no handshake reply from {self.endpoint} within {seconds:.1f}s")

    # ---- death and close ----

    def mark_dead(self, reason: str) -> None:
        """Declare the peer dead (any thread): every pending call fails with PeerDead now, every later call at once,
        and the socket is closed."""
        if self.on_owner_thread:
            self._die(reason)
            return
        try:
            self._loop.call_soon_threadsafe(self._die, reason)
        except RuntimeError:  # the loop is closed: nothing runs there any more, so settle from here
            self._die(reason)

    def _die(self, reason: str, exc: BaseException | None = None, goodbye: bool = False) -> None:
        with self._die_lock:
            self._die_locked(reason, exc, goodbye)

    def _die_locked(self, reason: str, exc: BaseException | None, goodbye: bool = False) -> None:
        if self._dead is None:
            self._dead = reason
        if self._hs_timer is not None:
            self._hs_timer.cancel()
        if not self._welcome.done():
            _settle(self._welcome, exc or PeerDeadError(reason))
            if self._welcome.done():
                self._welcome.exception()  # retrieved: nobody need await connect(), so no "never retrieved" log
        pending, self._pending = self._pending, {}
        self._outbox = []
        for call_id, entry in pending.items():
            entry.timer.cancel()
            if entry.token is not None:
                entry.token.remove_listener(entry.listener)  # type: ignore[arg-type]
            _settle(entry.sink, exc or m.PeerDead(call_id, reason))
        sock, self._sock = self._sock, None
        if sock is not None:
            if not self._loop.is_closed():
                self._loop.remove_reader(self._fd)
            if goodbye:  # closed by its owner: tell the server to forget this connection now
                try:
                    sock.send(_encode(m.Goodbye("client closed", self._session)), _NOBLOCK)
                except zmq.ZMQError:
                    goodbye = False
            sock.close(linger=GOODBYE_LINGER_MS if goodbye else 0)

    def close(self, timeout: float = 5.0) -> None:
        """Fail whatever is pending with PeerDead("client closed") and close the socket. From the loop's thread, or
        from any thread once the loop has stopped; from another thread while it runs, this hands the close to the
        loop and waits for it (up to `timeout`)."""
        if self._closed:
            return
        self._closed = True
        if self._unfollow is not None:
            self._unfollow()
            self._unfollow = None
        reason = f"{self.peer}: client closed"
        if self.on_owner_thread or not self._loop.is_running():
            self._die(reason, goodbye=True)
            return
        done = threading.Event()

        def close_here() -> None:
            self._die(reason, goodbye=True)
            done.set()

        try:
            self._loop.call_soon_threadsafe(close_here)
        except RuntimeError:  # closed between the check and now
            self._die(reason, goodbye=True)
            return
        if not done.wait(timeout):
            log.warning("async_client_close_timed_out", peer=self.peer)

    def __repr__(self) -> str:
        state = "alive" if self._dead is None else f"dead: {self._dead}"
        return f"AsyncRpcClient({self.peer!r}, {state}, pending={len(self._pending)})"


def _drop(reply: Any) -> None:
    pass


def _settle(sink: asyncio.Future[Any] | OnReply, outcome: Any) -> None:
    """Hand a call its outcome: a reply struct (a future's result) or an exception (a future's exception)."""
    if isinstance(sink, asyncio.Future):
        if sink.done():  # the awaiter was cancelled: the reply is dropped
            return
        try:
            if isinstance(outcome, BaseException):
                sink.set_exception(outcome)
            else:
                sink.set_result(outcome)
        except RuntimeError:  # its loop is closed (settled from close() after the loop stopped): nobody waits
            pass
        return
    try:
        sink(outcome)
    except Exception:  # a fire-and-forget callback's bug must not break the reader
        log.exception("oneway_callback_failed")


__all__ = ["AsyncRpcClient"]
