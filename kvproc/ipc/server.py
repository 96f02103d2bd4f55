"""The server side of kvproc's RPC: one ROUTER socket, one thread that owns it, handlers on a bounded pool.

Threads:
- the socket thread runs `serve()`: it polls the ROUTER and a wake-up fd (or, when no call is in flight off this
  thread and the outbox is empty, sleeps in a receive on the ROUTER alone), decodes frames, answers the handshake,
  heartbeats and `Ping` itself (O(1), the transport's own probe), runs the requests the service declares inline
  (O(1) and non-blocking) and hands every other request to the pool;
- handler threads (a bounded `ThreadPoolExecutor`) run the service's handlers and post encoded replies to the outbox
  queue, then wake the socket thread. The socket thread never runs a pooled handler; a handler never touches the
  socket.

Guarantees:
- every accepted `Call` gets exactly one terminal reply (`_in_flight` is the single place a call lives; a reply pops
  it, a second reply finds nothing and is counted as late). When the server stops, its peers get `Goodbye` and fail
  whatever is still pending with PeerDead;
- a malformed, oversized or unknown frame gets a typed `Failed` (call id 0 when none could be read), a rate-limited
  log line, and the loop keeps serving. Frames above 4x `max_frame_bytes` are refused by ZeroMQ itself
  (`MAXMSGSIZE`, the peer is disconnected) so a hostile peer cannot make the process allocate without bound;
- no unbounded queue on the receive side: at most `max_in_flight` calls are accepted, the rest get `overloaded`.
"""

from __future__ import annotations

import hmac
import os
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence, get_args

import msgspec
import structlog
import zmq

from kvproc.ipc import messages as m
from kvproc.ipc.cancel import REGISTRY
from kvproc.ipc.context import DEFERRED, CallContext
from kvproc.ipc.errors import CallCancelled, DeadlineExceeded, HandlerError
from kvproc.ipc.service import Service
from kvproc.ipc.sockets import EVENTS, NOBLOCK, POLLIN, SNDMORE_NOBLOCK, configure_socket
from kvproc.ipc.wake import Waker

log = structlog.get_logger(__name__)

_PAYLOADS = frozenset(get_args(m.PayloadBody))
_encode = m.encode


class _RateLimitedLog:
    """At most `per_s` warnings a second; the rest are counted and summarised, so a hostile peer cannot flood."""

    def __init__(self, per_s: int = 10) -> None:
        self.per_s = per_s
        self.window = 0.0
        self.count = 0
        self.suppressed = 0

    def warn(self, event: str, **kw: Any) -> None:
        now = time.monotonic()
        if now - self.window >= 1.0:
            if self.suppressed:
                log.warning("log_suppressed", suppressed=self.suppressed, last_event=event)
            self.window, self.count, self.suppressed = now, 0, 0
        self.count += 1
        if self.count <= self.per_s:
            log.warning(event, **kw)
        else:
            self.suppressed += 1


# The longest the socket thread sleeps in an idle receive before it looks at `stop()` again (`RpcServer.serve`).
IDLE_SLICE_MS = 50


class RpcServer:
    # False: always poll the socket with the waker (the A/B arm of bench/RESULTS.md)
    receive_when_idle = True

    def __init__(
        self,
        service: Service,
        *,
        endpoints: Sequence[str],
        token: str,
        role: str,
        rank: int = 0,
        workers: int = 4,
        max_in_flight: int = 256,
        max_frame_bytes: int = 1 << 20,
        hwm: int = 10_000,
        max_peers: int = 1024,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.service = service
        self.role, self.rank, self.pid = role, rank, os.getpid()
        self._endpoints = list(endpoints)
        self._token = token
        self._table = service.handler_table()
        # Requests the service declares O(1) and non-blocking are run on this socket thread: two thread hand-offs
        # less per call (a host-tier query is dict work; its round trip is most of a resolve's overhead).
        self._inline = frozenset(service.inline) & frozenset(self._table)
        self._max_in_flight = max_in_flight
        self._max_frame = max_frame_bytes
        self._max_peers = max_peers
        self._sock = (context or zmq.Context.instance()).socket(zmq.ROUTER)
        configure_socket(self._sock, hwm=hwm)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply raises (counted) instead of vanishing
        self._sock.setsockopt(zmq.MAXMSGSIZE, 4 * max_frame_bytes + 4096)
        self._sock.setsockopt(zmq.RCVTIMEO, IDLE_SLICE_MS)  # only the idle receive blocks (`serve`)
        self._decoder = m.server_decoder()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"kvproc-{role}{rank}-h")
        self._in_flight: dict[tuple[bytes, int], CallContext] = {}
        self._outbox: queue.SimpleQueue[tuple[bytes, bytes]] = queue.SimpleQueue()
        self._waker = Waker()
        self._post_lock = threading.Lock()
        self._closed = False
        self._peers: dict[bytes, str] = {}
        self._io_ident = 0
        self._stopping = False
        self._warn = _RateLimitedLog()
        self.started_at = time.monotonic()
        self.bound: list[str] = []
        self.msgs_in = 0
        self.msgs_out = 0
        self.errors = 0
        self.dropped = 0
        self.late_replies = 0
        self.inline_calls = 0
        self.inline_ns = 0  # socket-thread time in inline handlers, their replies sent included

    # ---- lifecycle ----

    def bind(self) -> list[str]:
        """Bind every endpoint; returns the resolved endpoints (a tcp port 0 becomes the real port)."""
        for ep in self._endpoints:
            self._sock.bind(ep)
            self.bound.append(self._sock.getsockopt_string(zmq.LAST_ENDPOINT))
        return list(self.bound)

    def serve(self) -> None:
        """Run the socket loop in the calling thread until `stop()`; closes the socket on the way out."""
        self._io_ident = threading.get_ident()
        poller = zmq.Poller()
        poller.register(self._sock, POLLIN)
        poller.register(self._waker.fd, POLLIN)
        sock = self._sock
        try:
            while not self._stopping:
                if self.receive_when_idle and self._idle():
                    # Nothing is being handled off this thread, so nothing can post a reply to the outbox: sleep in
                    # a receive on the socket alone (~10-15 us less per message than a poll of the socket and the
                    # waker, whose CPU time also lands on the two peers of a 2-vCPU host); `stop()` is noticed at
                    # the slice's end.
                    try:
                        first = sock.recv(copy=False)
                    except zmq.Again:
                        continue
                    self._read_socket(first)
                else:
                    # The timeout is only a backstop for a lost wake-up; all work arrives as a poll event.
                    for item, _ in poller.poll(1000):
                        if item is sock:
                            self._read_socket()
                        else:
                            self._waker.drain()
                self._flush_outbox()
        finally:
            self._close()

    def start(self, name: str | None = None) -> threading.Thread:
        """Run `serve()` on a daemon thread (the launcher's control server; in-process tests)."""
        t = threading.Thread(target=self.serve, name=name or f"kvproc-{self.role}{self.rank}-io", daemon=True)
        t.start()
        return t

    def stop(self) -> None:
        """Thread- and signal-safe: the socket thread finishes its current batch, says Goodbye and exits."""
        self._stopping = True
        self._waker.wake()

    def _close(self) -> None:
        try:
            self.service.on_stop()
        except Exception:
            log.exception("service_on_stop_failed", role=self.role)
        for ctx in list(self._in_flight.values()):
            if ctx.token is not None:
                ctx.token.cancel()  # let running handlers stop between operations
        bye = _encode(m.Goodbye(f"{self.role}[{self.rank}] pid {self.pid} is shutting down"))
        self._flush_outbox()
        for ident in list(self._peers):
            self._send(ident, bye)
        with self._post_lock:
            self._closed = True
            self._waker.close()
        # A short bounded linger (not 0) so the Shutdown reply and Goodbye frames reach the peers; never a hang.
        self._sock.close(linger=100)
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- the socket thread ----

    def _read_socket(self, first: zmq.Frame | None = None) -> None:
        """Handle the messages waiting on the socket (a bounded batch); `first`: the first frame of the first one,
        already received."""
        sock = self._sock
        for i in range(512):  # bounded batch so replies in the outbox are not starved by a flood of requests
            # The poll said readable (or `first` came), so the first message is there; after it, ask the socket
            # (cheaper than catching zmq.Again at the end of every batch).
            if i and not sock.getsockopt(EVENTS) & POLLIN:
                return
            # A ROUTER delivers [identity, body]; read the two frames by hand (recv_multipart costs more per call).
            # As Frames: `.more` is read off the message itself, while getsockopt(RCVMORE) costs ~2 us in pyzmq 27
            # (it builds a SocketOption enum on every call).
            ident_f = first if first is not None and i == 0 else sock.recv(NOBLOCK, copy=False)
            ident = ident_f.bytes
            self.msgs_in += 1
            if not ident_f.more:
                self._frame_error(ident, "malformed", "empty message")
                continue
            data_f = sock.recv(NOBLOCK, copy=False)
            data = data_f.bytes
            if data_f.more:
                extra = 1
                while sock.recv(NOBLOCK, copy=False).more:
                    extra += 1
                self._frame_error(ident, "malformed", f"expected 1 frame, got {extra + 1}")
                continue
            if len(data) > self._max_frame:
                self._frame_error(ident, "oversized", f"frame of {len(data)} B > limit {self._max_frame} B")
                continue
            try:
                msg = self._decoder.decode(data)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                self._frame_error(ident, "malformed", str(e))
                continue
            kind = type(msg)
            if kind is m.Call:
                self._on_call(ident, msg)
            elif ident not in self._peers:
                if kind is m.Hello:
                    self._on_hello(ident, msg)
                else:
                    self._frame_error(ident, "not_authenticated", f"{kind.__name__} before Hello")
            elif kind is m.Heartbeat:
                self._send(ident, _encode(m.HeartbeatAck(msg.seq)))
            elif kind is m.Cancel:
                REGISTRY.cancel(msg.token)
            elif kind is m.Hello:
                self._on_hello(ident, msg)

    def _on_hello(self, ident: bytes, msg: m.Hello) -> None:
        if msg.version != m.PROTOCOL_VERSION:
            reply: m.Wire = m.Refused("protocol_mismatch", m.version_mismatch_message(msg.version, m.PROTOCOL_VERSION))
        elif not hmac.compare_digest(msg.token.encode(), self._token.encode()):
            reply = m.Refused("bad_token", "the auth token does not match this cluster's (see its runtime dir)")
        elif len(self._peers) >= self._max_peers and ident not in self._peers:
            reply = m.Refused("too_many_peers", f"{self._max_peers} peers already connected")
        else:
            self._peers[ident] = msg.client
            reply = m.Welcome(m.PROTOCOL_VERSION, self.role, self.rank, self.pid)
        if type(reply) is m.Refused:
            self.errors += 1
            self._warn.warn("handshake_refused", code=reply.code, client=msg.client, client_version=msg.version)
        self._send(ident, _encode(reply))

    def _on_call(self, ident: bytes, msg: m.Call) -> None:
        body = msg.body
        if ident not in self._peers:
            self.errors += 1
            self._send(ident, _encode(m.Failed(msg.call_id, "not_authenticated", "HandshakeRequired", "send Hello")))
            return
        if type(body) is m.Ping:  # the transport's own probe: answered here, never queued behind handlers
            self._send(ident, _encode(m.Ok(msg.call_id, m.Pong(body.data, self.pid))))
            return
        key = (ident, msg.call_id)
        if key in self._in_flight:
            self.errors += 1
            self._send(ident, _encode(m.Failed(msg.call_id, "duplicate_call", "ProtocolError", "call id in use")))
            return
        token = REGISTRY.acquire(msg.token) if msg.token else None
        ctx = CallContext(self, ident, msg.call_id, msg.deadline_ns, token)
        self._in_flight[key] = ctx
        handler = self._table.get(type(body))
        if handler is None:
            missing = f"{self.role} has no handler for {type(body).__name__}"
            self._reply_exc(ctx, HandlerError("unknown_request", missing))
        elif len(self._in_flight) > self._max_in_flight:
            self._reply_exc(ctx, HandlerError("overloaded", f"{self._max_in_flight} calls already in flight"))
        elif type(body) in self._inline:
            t0 = time.perf_counter_ns()
            self._run(handler, body, ctx)  # checks the deadline and the token first, like a pooled call
            self.inline_ns += time.perf_counter_ns() - t0
            self.inline_calls += 1
        else:
            try:
                ctx.check()  # already cancelled or past its deadline: answer without queueing it
            except (CallCancelled, DeadlineExceeded) as e:
                self._reply_exc(ctx, e)
                return
            self._pool.submit(self._run, handler, body, ctx)

    def _frame_error(self, ident: bytes, code: str, detail: str) -> None:
        self.errors += 1
        self._warn.warn("bad_frame", code=code, detail=detail[:200])
        self._send(ident, _encode(m.Failed(0, code, "FrameError", detail[:200])))

    def _send(self, ident: bytes, data: bytes) -> None:
        try:
            self._sock.send(ident, SNDMORE_NOBLOCK)
            self._sock.send(data, NOBLOCK)
            self.msgs_out += 1
        except zmq.ZMQError:  # peer gone (EHOSTUNREACH) or its queue is at the high-water mark (EAGAIN)
            self.dropped += 1

    def _flush_outbox(self) -> None:
        out = self._outbox
        while not out.empty():
            ident, data = out.get_nowait()
            self._send(ident, data)

    # ---- handler threads ----

    def _run(self, handler: Any, body: Any, ctx: CallContext) -> None:
        try:
            ctx.check()
            result = handler(body, ctx)
        except BaseException as e:  # noqa: BLE001 -- every failure becomes the caller's typed reply
            self._reply_exc(ctx, e)
            return
        if result is not DEFERRED:
            self._reply_ok(ctx, result)

    def _reply_ok(self, ctx: CallContext, payload: Any) -> bool:
        if type(payload) not in _PAYLOADS:
            exc = TypeError(f"handler returned {type(payload).__name__}, not a messages.PayloadBody member")
            return self._reply_exc(ctx, exc)
        return self._finish(ctx, m.Ok(ctx.call_id, payload))

    def _reply_exc(self, ctx: CallContext, exc: BaseException) -> bool:
        reply: m.Wire
        if isinstance(exc, CallCancelled):
            reply = m.Cancelled(ctx.call_id, ctx.token.id if ctx.token else exc.token)
        elif isinstance(exc, DeadlineExceeded):
            reply = m.Failed(ctx.call_id, "deadline_exceeded", "DeadlineExceeded", str(exc))
        elif isinstance(exc, HandlerError):
            reply = m.Failed(ctx.call_id, exc.code, type(exc).__name__, str(exc))
        else:
            self.errors += 1
            log.error("handler_failed", role=self.role, exc_type=type(exc).__qualname__, exc_info=exc)
            reply = m.Failed(ctx.call_id, "internal", type(exc).__qualname__, str(exc))
        return self._finish(ctx, reply)

    def _finish(self, ctx: CallContext, reply: m.Wire) -> bool:
        if threading.get_ident() == self._io_ident:
            if self._in_flight.pop(ctx._key, None) is None:  # dict.pop is atomic: the first reply wins
                self.late_replies += 1
                return False
            self._release_token(ctx)
            self._send(ctx.peer, _encode(reply))
            return True
        data = _encode(reply)  # before the lock (a late reply's encoding is wasted; late replies are rare)
        with self._post_lock:
            # The call leaves `_in_flight` and its reply enters the outbox in one step: the socket thread, which
            # sleeps in a receive (not watching the waker) only when it sees neither, cannot miss it (`serve`).
            if self._in_flight.pop(ctx._key, None) is None:
                self.late_replies += 1
                return False
            if not self._closed:
                self._outbox.put((ctx.peer, data))
                self._waker.wake()
        self._release_token(ctx)
        return True

    @staticmethod
    def _release_token(ctx: CallContext) -> None:
        if ctx.token is not None:
            REGISTRY.release(ctx.token)

    def _idle(self) -> bool:
        """No call is handled off the socket thread and no reply waits in the outbox (so none can arrive there)."""
        with self._post_lock:
            return not self._in_flight and self._outbox.empty()

    # ---- introspection (any thread) ----

    def transport_stats(self) -> dict[str, int]:
        work_queue = getattr(self._pool, "_work_queue", None)
        return {
            "in_flight": len(self._in_flight),
            "queued": work_queue.qsize() if work_queue is not None else 0,
            "outbox": self._outbox.qsize(),
            "msgs_in": self.msgs_in,
            "msgs_out": self.msgs_out,
            "errors": self.errors,
            "dropped": self.dropped,
            "late_replies": self.late_replies,
            "inline_calls": self.inline_calls,
            "inline_ns": self.inline_ns,
            "peers": len(self._peers),
        }
