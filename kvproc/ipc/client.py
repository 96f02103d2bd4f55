"""The client side of kvproc's RPC: one DEALER socket owned by one I/O thread; any thread may call.

`call(msg, deadline=..., cancel_token=...)` returns a `concurrent.futures.Future` that always resolves to exactly one
terminal reply -- `Ok`, `Failed`, `Cancelled` or `PeerDead` -- and never raises; `reply.unwrap()` turns it into the
payload or a typed exception. Asyncio code awaits it (the store's loop: `tiers/remote.py`, `await_sync_call`);
`request()` is the blocking form. Blocking callers are few and off every hot path (set-up, stats,
consoles): a socket per calling thread, which saved two thread hand-offs a call, was removed with the blocking
resolver it served (bench/RESULTS.md, "Control path").

Why a call always ends:
- the server replies (its handlers' exceptions become `Failed`, never a silent drop);
- or the peer is declared dead -- by the launcher watching the child's sentinel (`mark_dead`), by the server's
  `Goodbye`, or by missed heartbeats (for peers nobody here supervises) -- and every pending call fails with
  `PeerDead` at once, as does every later call;
- or, as a backstop, the I/O thread fails a call locally once its deadline plus a small grace has passed.
"""

from __future__ import annotations

import heapq
import itertools
import os
import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError
from typing import Any, Callable

import msgspec
import structlog
import zmq

from kvproc.ipc import messages as m
from kvproc.ipc.cancel import CancelToken
from kvproc.ipc.errors import CallCancelled, DeadlineExceeded, HandshakeRefused, PeerDeadError
from kvproc.ipc.sockets import GOODBYE_LINGER_MS, NOBLOCK, POLLIN, configure_socket, new_session
from kvproc.ipc.undecodable import failed_for
from kvproc.ipc.wake import Waker

log = structlog.get_logger(__name__)
_encode = m.encode
_TERMINAL = (m.Ok, m.Failed, m.Cancelled, m.PeerDead)


class _Pending:
    __slots__ = ("future", "token", "listener")

    def __init__(self, future: Future[Any], token: CancelToken | None, listener: Any) -> None:
        self.future = future
        self.token = token
        self.listener = listener


class RpcClient:
    def __init__(
        self,
        endpoint: str,
        *,
        token: str,
        name: str = "client",
        peer: str = "",
        context: zmq.Context[Any] | None = None,
        hwm: int = 10_000,
        heartbeat_s: float | None = 1.0,
        liveness: int = 3,
        default_timeout_s: float = 30.0,
        deadline_grace_s: float = 0.1,
    ) -> None:
        self.endpoint = endpoint
        self.peer = peer or endpoint  # how errors name the other side, e.g. "host_tier[0]"
        self.name = name
        self.default_timeout_s = default_timeout_s
        self._token = token
        self._ctx = context or zmq.Context.instance()
        self._hwm = hwm
        self._heartbeat_s = heartbeat_s
        self._liveness = liveness
        self._grace = deadline_grace_s
        self._ids = itertools.count(1)  # 0 is reserved for frame errors that carry no call id
        # The I/O socket's session id: every message on it carries it (`messages.py`, "Sessions"). `identity` is the
        # client identity the server bounds its peers by: one per process.
        self._session = new_session()
        self.identity = f"{name}@{os.getpid()}"
        self._goodbye = False  # close(): the I/O socket says Goodbye before it closes
        self._lock = threading.Lock()
        self._pending: dict[int, _Pending] = {}
        self._dead: str | None = None
        self._death_listeners: list[Callable[[str], None]] = []
        self._closing = False
        self._outbox: queue.SimpleQueue[tuple[bytes, int, float]] = queue.SimpleQueue()
        self._waker = Waker()
        self._welcome: Future[m.Welcome] = Future()
        self._thread: threading.Thread | None = None
        self.server_pid = 0
        self.msgs_in = 0
        self.msgs_out = 0
        self.frame_errors = 0
        self.last_frame_error = ""

    # ---- lifecycle ----

    def connect(self, timeout: float = 5.0) -> m.Welcome:
        """Start the I/O thread and shake hands; raises HandshakeRefused or PeerDeadError (after `timeout`)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._io_main, name=f"kvproc-client-{self.peer}", daemon=True)
            self._thread.start()
            self._post(_encode(m.Hello(m.PROTOCOL_VERSION, self._token, self.identity, self._session)))
        try:
            welcome = self._welcome.result(timeout)
        except TimeoutError:
            self.close()
            raise PeerDeadError(f"{self.peer}: no handshake reply from {self.endpoint} within {timeout:.1f}s") from None
        except BaseException:
            self.close()
            raise
        self.server_pid = welcome.pid
        return welcome

    def close(self) -> None:
        """Fail whatever is pending with PeerDead("client closed") and stop the I/O thread. The socket says `Goodbye`
        on the way out (when the peer is not dead), so the server forgets it at once rather than when it sees the
        connection close."""
        self._goodbye = True
        self.mark_dead(f"{self.peer}: client closed")
        self._closing = True
        self._waker.wake()
        if self._thread is None:
            self._waker.close()  # never connected: no I/O thread to close it
        elif self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def mark_dead(self, reason: str) -> None:
        """Declare the peer dead: every pending call resolves to PeerDead now, every later call at once."""
        with self._lock:
            if self._dead is not None:
                return
            self._dead = reason
            pending, self._pending = self._pending, {}
            listeners, self._death_listeners = self._death_listeners, []
        if not self._welcome.done():
            self._welcome.set_exception(PeerDeadError(reason))
        for call_id, entry in pending.items():
            self._resolve(entry, m.PeerDead(call_id, reason))
        self._waker.wake()
        for fn in listeners:
            try:
                fn(reason)
            except Exception:  # one listener's bug must not stop the others (or the supervisor)
                log.exception("death_listener_failed", peer=self.peer)

    def add_death_listener(self, fn: Callable[[str], None]) -> Callable[[], None]:
        """Call `fn(reason)` once when this client is declared dead (at once, here, if it already is), from whichever
        thread declares it (keep `fn` short and thread-safe, e.g. `loop.call_soon_threadsafe`). Returns a function
        that unsubscribes `fn`."""
        with self._lock:
            dead = self._dead
            if dead is None:
                self._death_listeners.append(fn)
        if dead is not None:
            fn(dead)

        def remove() -> None:
            with self._lock:
                try:
                    self._death_listeners.remove(fn)
                except ValueError:
                    pass

        return remove

    @property
    def alive(self) -> bool:
        return self._dead is None

    @property
    def dead_reason(self) -> str | None:
        return self._dead

    @property
    def pending_count(self) -> int:
        """Calls in flight to this peer."""
        return len(self._pending)

    # ---- calling (any thread) ----

    def call(
        self,
        msg: m.RequestBody,
        *,
        deadline: float | None = None,
        timeout: float | None = None,
        cancel_token: CancelToken | None = None,
    ) -> Future[Any]:
        """Send `msg`; the future resolves to one of Ok / Failed / Cancelled / PeerDead.

        `deadline` is absolute `time.monotonic()` seconds; `timeout` is relative; default `default_timeout_s`.
        """
        fut: Future[Any] = Future()
        call_id = next(self._ids)
        if deadline is None:
            deadline = time.monotonic() + (self.default_timeout_s if timeout is None else timeout)
        if cancel_token is not None and cancel_token.cancelled:
            fut.set_result(m.Cancelled(call_id, cancel_token.id))
            return fut
        listener = self._send_cancel if cancel_token is not None else None
        with self._lock:
            if self._dead is not None:
                fut.set_result(m.PeerDead(call_id, self._dead))
                return fut
            self._pending[call_id] = _Pending(fut, cancel_token, listener)
        data = _encode(m.Call(call_id, int(deadline * 1e9), msg, cancel_token.id if cancel_token else 0,
                              self._session))
        self._outbox.put((data, call_id, deadline))
        self._waker.wake()
        if cancel_token is not None and not cancel_token.add_listener(self._send_cancel):
            self._send_cancel(cancel_token.id)  # cancelled between the check above and now
        return fut

    def request(self, msg: m.RequestBody, *, deadline: float | None = None, timeout: float | None = None,
                cancel_token: CancelToken | None = None) -> Any:
        """Blocking form of `call`: returns the payload or raises RemoteError / CallCancelled / PeerDeadError."""
        if deadline is None:
            deadline = time.monotonic() + (self.default_timeout_s if timeout is None else timeout)
        if self._dead is not None:
            raise PeerDeadError(self._dead)
        if cancel_token is not None and cancel_token.cancelled:
            raise CallCancelled(cancel_token.id)
        fut = self.call(msg, deadline=deadline, cancel_token=cancel_token)
        try:
            reply = fut.result(max(0.0, deadline - time.monotonic()) + self._grace + 5.0)
        except TimeoutError:
            raise DeadlineExceeded(f"{self.peer}: no reply to {type(msg).__name__} (client I/O stalled)") from None
        return reply.unwrap()

    def send_oneway(self, msg: m.RequestBody, *, timeout: float, on_reply: Callable[[Any], None]) -> None:
        """Fire-and-forget: send `msg`; its one terminal reply (Ok / Failed / Cancelled / PeerDead) goes to
        `on_reply` later, on the I/O thread. Never raises."""
        self.call(msg, deadline=time.monotonic() + timeout).add_done_callback(lambda f: on_reply(f.result()))

    def cancel(self, token_id: int) -> None:
        """Send `Cancel(token_id)` to this peer (normally done for you when a passed CancelToken is cancelled)."""
        self._send_cancel(token_id)

    def _send_cancel(self, token_id: int) -> None:
        self._post(_encode(m.Cancel(token_id, self._session)))

    def _post(self, data: bytes) -> None:
        self._outbox.put((data, 0, 0.0))
        self._waker.wake()

    def _resolve(self, entry: _Pending, reply: Any) -> None:
        if entry.token is not None:
            entry.token.remove_listener(entry.listener)
        # A caller may have cancelled its future (e.g. an asyncio wait_for around wrap_future): drop the reply then,
        # never let it crash this I/O thread.
        if not entry.future.cancelled():
            try:
                entry.future.set_result(reply)
            except InvalidStateError:
                pass

    def _complete(self, call_id: int, reply: Any) -> None:
        with self._lock:
            entry = self._pending.pop(call_id, None)
        if entry is not None:  # None: already failed locally (deadline backstop, death): the late reply is dropped
            self._resolve(entry, reply)

    # ---- the I/O thread ----

    def _io_main(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        configure_socket(sock, hwm=self._hwm)
        try:
            sock.connect(self.endpoint)
            self._io_loop(sock)
        except Exception as e:  # a bug here must not leave callers waiting: fail everything, loudly
            log.exception("client_io_crashed", peer=self.peer)
            self.mark_dead(f"{self.peer}: client I/O thread crashed: {e!r}")
        finally:
            if self._goodbye and self._welcome.done() and self._welcome.exception() is None:
                # Closed by its owner while the server is reachable: tell it to forget this connection now.
                try:
                    sock.send(_encode(m.Goodbye("client closed", self._session)), NOBLOCK)
                except zmq.ZMQError:
                    pass
                sock.close(linger=GOODBYE_LINGER_MS)
            else:
                sock.close(linger=0)
            self._waker.close()

    def _io_loop(self, sock: zmq.Socket[Any]) -> None:
        decoder = m.client_decoder()
        poller = zmq.Poller()
        poller.register(sock, POLLIN)
        poller.register(self._waker.fd, POLLIN)
        deadlines: list[tuple[float, int]] = []
        hb_seq = 0
        last_heard = last_hb = time.monotonic()
        # When the first heartbeat sent since the peer was last heard went out (None: none is unanswered). The peer
        # is judged on it, not on the silence alone: a stall of this process (a VM paused, the host starved, a GIL
        # hog) makes every peer look silent for its length, and without a heartbeat out over it nobody was asked.
        # Judging the silence alone declared a cluster's healthy children dead together, after a 3 s stall of the
        # launcher's process (`kvproc bench ipc --observe-toggle`, stop 31): its saves shed, its resolves missed.
        # The price: a process held up more than a heartbeat at every turn never judges its peers (its calls still
        # end at their deadlines, and the launcher sees a child's exit by its sentinel).
        asked_at: float | None = None
        last_check = last_heard  # when the peer was last judged: every heartbeat / 2 or sooner, unless stalled
        while not self._closing and self._dead is None:
            now = time.monotonic()
            wait = 1.0
            if deadlines:
                wait = min(wait, deadlines[0][0] - now)
            if self._heartbeat_s is not None:
                wait = min(wait, self._heartbeat_s / 2)
            for item, _ in poller.poll(max(0, int(wait * 1000) + 1)):
                if item is sock:
                    last_heard = time.monotonic()
                    asked_at = None
                    self._read(sock, decoder)
                else:
                    self._waker.drain()
            while not self._outbox.empty():
                data, call_id, deadline = self._outbox.get_nowait()
                try:
                    sock.send(data, NOBLOCK)
                    self.msgs_out += 1
                except zmq.Again:  # at the high-water mark: fail this call now rather than queue without bound
                    if call_id:
                        self._complete(call_id, m.Failed(call_id, "overloaded", "Backpressure", "send queue full"))
                    continue
                if call_id:
                    heapq.heappush(deadlines, (deadline + self._grace, call_id))
            now = time.monotonic()
            while deadlines and deadlines[0][0] <= now:
                _, call_id = heapq.heappop(deadlines)
                if call_id in self._pending:
                    msg = f"{self.peer}: no reply within the deadline (local backstop)"
                    self._complete(call_id, m.Failed(call_id, "deadline_exceeded", "DeadlineExceeded", msg))
            if self._heartbeat_s is not None and self._welcome.done():
                if now - last_check > self._heartbeat_s:
                    # This loop itself was held up longer than a heartbeat: a heartbeat sent before the stall may
                    # have its reply still on the way (the peer stalled too: a paused VM). Ask again.
                    asked_at = None
                last_check = now
                silent = now - last_heard
                # Dead: a heartbeat out unanswered for `liveness - 1` heartbeats. It went out after one silent
                # heartbeat, so the peer has been silent for `liveness` of them (the usual case: as before).
                if asked_at is not None and now - asked_at > self._heartbeat_s * (self._liveness - 1):
                    self.mark_dead(f"{self.peer}: no heartbeat reply for {silent:.1f}s "
                                   f"(the first unanswered one sent {now - asked_at:.1f}s ago)")
                elif silent > self._heartbeat_s and now - last_hb > self._heartbeat_s:
                    hb_seq += 1
                    last_hb = now
                    if asked_at is None:
                        asked_at = now
                    try:
                        sock.send(_encode(m.Heartbeat(hb_seq, self._session)), NOBLOCK)
                    except zmq.Again:
                        pass

    def _read(self, sock: zmq.Socket[Any], decoder: msgspec.msgpack.Decoder[Any]) -> None:
        for _ in range(512):
            try:
                data = sock.recv(NOBLOCK)
            except zmq.Again:
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
                if msg.call_id == 0:  # the server could not read one of our frames
                    self.frame_errors += 1
                    self.last_frame_error = f"{msg.code}: {msg.message}"
                    log.warning("server_rejected_frame", peer=self.peer, code=msg.code, detail=msg.message)
                else:
                    self._complete(msg.call_id, msg)
                if type(msg) is m.Failed and msg.code == "not_authenticated" and self._welcome.done():
                    # The server does not know our session: another process answers at the endpoint now (a tier
                    # restarted on its runtime dir: ZeroMQ reconnected us to it silently), or it forgot us. Its
                    # refusals would otherwise count as heard heartbeats and keep this client "alive" forever
                    # (issue 39, item 4): dead, so that the owner reconnects with a Hello of its own.
                    self.mark_dead(f"{self.peer}: the server does not know this connection's session (it was "
                                   f"replaced or restarted, or it forgot us): {msg.message}")
                    return
            elif kind is m.Goodbye:
                self.mark_dead(f"{self.peer}: said goodbye: {msg.reason}")
            elif kind is m.Welcome:
                if not self._welcome.done():
                    self._welcome.set_result(msg)
            elif kind is m.Refused:
                if not self._welcome.done():
                    self._welcome.set_exception(HandshakeRefused(msg.code, msg.message))
