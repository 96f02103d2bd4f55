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
  A call whose handler deferred its reply (a parked waiter, e.g. the host tier's `WaitSettled`) counts against a
  bound of its own (`max_parked`), not that one: a burst of waiters cannot make the tier refuse the calls that
  settle them (`CommitSave`);
- no unbounded queue on the send side: at most `sndhwm` replies wait for one peer that does not read (ZeroMQ's
  send high-water mark, per connection); a reply beyond it is dropped and counted (`dropped_hwm`), and the caller's
  deadline ends its call. The outbox holds at most one reply per call in flight.

Peers (authenticated connections) and their lifetime:
- a connection is admitted by a `Hello` with the cluster's token and a session id (`sockets.new_session`); every
  later message must carry that session, so a socket that takes over the routing id (ZMQ_ROUTING_ID) of an
  admitted one is not served without its own Hello. The check is one int comparison per message;
- a peer is forgotten when its client says `Goodbye` (every kvproc client socket does on close), when its connection
  closes (the socket's monitor reports it: each peer is tied to its connection's fd, read off its Hello frame), or,
  for a peer whose connection cannot be tracked (inproc), after `peer_idle_s` without a message. At most
  `max_peers_per_client` peers per client identity (`Hello.client`): a new one past that evicts the identity's
  least recently heard one (its connection is closed). At `max_peers` a new Hello is refused (`too_many_peers`);
- a connection that has not been admitted within `hello_deadline_s` of being accepted (it never said Hello, or only
  with a bad token) is closed by the server (the socket's fd is shut down; ZeroMQ then drops the connection).
All of these are counted (`transport_stats`).
"""

from __future__ import annotations

import hmac
import os
import queue
import socket as _socket
import struct
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Sequence, cast, get_args

import msgspec
import structlog
import zmq

from kvproc.ipc import messages as m
from kvproc.ipc.cancel import REGISTRY
from kvproc.ipc.context import DEFERRED, CallContext
from kvproc.ipc.errors import CallCancelled, DeadlineExceeded, HandlerError
from kvproc.ipc.service import Service
from kvproc.ipc.sockets import EVENTS, NOBLOCK, POLLIN, SNDMORE_NOBLOCK, configure_socket, new_session
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
# How often the socket thread reads its socket's monitor events and enforces Hello deadlines and idle expiry.
HOUSEKEEP_S = 0.1
_MON_HEAD = struct.Struct("=HI")  # a monitor event's first frame: event (uint16), value (uint32: here, the fd)
_ACCEPTED = int(zmq.EVENT_ACCEPTED)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)
_SRCFD = int(zmq.SRCFD)


class _Peer:
    """An admitted connection: the session its messages must carry, its client identity, its connection's fd (-1:
    not tracked) and when it was last heard from (`RpcServer._clock`)."""

    __slots__ = ("session", "client", "fd", "seen")

    def __init__(self, session: int, client: str, fd: int, seen: float) -> None:
        self.session, self.client, self.fd, self.seen = session, client, fd, seen


class _Conn:
    """A connection the socket monitor reported accepted: its fd, the socket's inode (an fd number is reused once
    closed; the inode names the socket itself), its Hello deadline, and the routing id it was admitted as."""

    __slots__ = ("fd", "ino", "deadline", "ident")

    def __init__(self, fd: int, ino: int, deadline: float) -> None:
        self.fd, self.ino, self.deadline = fd, ino, deadline
        self.ident: bytes | None = None


def _frame_fd(frame: zmq.Frame) -> int:
    """The fd of the connection a received frame came on; -1 when it has none (inproc) or ZeroMQ does not say."""
    try:
        return int(frame.get(_SRCFD))
    except (zmq.ZMQError, TypeError, ValueError):
        return -1


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
        sndhwm: int = 1000,
        max_parked: int = 4096,
        max_peers_per_client: int = 256,
        hello_deadline_s: float = 30.0,
        peer_idle_s: float = 600.0,
        track_connections: bool = True,
    ) -> None:
        """`hwm`: the receive high-water mark per connection; `sndhwm`: the send one (replies queued for a peer that
        does not read, then dropped and counted). `max_parked`: calls whose reply is deferred (waiters), bounded apart
        from `max_in_flight`. `hello_deadline_s` (0: none): a connection not admitted by then is closed.
        `peer_idle_s`: a peer whose connection cannot be tracked is forgotten after this long without a message.
        `track_connections`: follow connections through the socket's monitor (fds; False: Goodbye and idle expiry
        only, no Hello deadline)."""
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
        self._max_per_client = max(1, max_peers_per_client)
        self._max_parked = max_parked
        self._hello_deadline = hello_deadline_s
        self._peer_idle = peer_idle_s
        ctx = context or zmq.Context.instance()
        self._sock = ctx.socket(zmq.ROUTER)
        configure_socket(self._sock, hwm=hwm)
        self._sock.setsockopt(zmq.SNDHWM, sndhwm)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply raises (counted) instead of vanishing
        self._sock.setsockopt(zmq.MAXMSGSIZE, 4 * max_frame_bytes + 4096)
        self._sock.setsockopt(zmq.RCVTIMEO, IDLE_SLICE_MS)  # only the idle receive blocks (`serve`)
        if hello_deadline_s > 0:  # ZeroMQ's own greeting/handshake bound, below ours
            self._sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, int(hello_deadline_s * 1000)))
        # Connection tracking: the socket's monitor reports each accepted and closed connection with its fd; a
        # Hello frame names its connection's fd (ZMQ_SRCFD). Owned by the socket thread.
        self._mon: zmq.Socket[Any] | None = None
        if track_connections:
            addr = f"inproc://kvproc-mon-{os.getpid()}-{id(self):x}"
            self._sock.monitor(addr, _ACCEPTED | _DISCONNECTED)
            self._mon = ctx.socket(zmq.PAIR)
            self._mon.setsockopt(zmq.LINGER, 0)
            self._mon.setsockopt(zmq.RCVHWM, 0)  # never drop an event: the socket thread drains them every slice
            self._mon.connect(addr)
        self._conns: dict[int, _Conn] = {}  # fd -> the connection on it
        self._pending_hello: deque[_Conn] = deque()  # accepted, not yet admitted: in deadline order
        self._decoder = m.server_decoder()
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix=f"kvproc-{role}{rank}-h")
        self._in_flight: dict[tuple[bytes, int], CallContext] = {}
        self._parked: set[tuple[bytes, int]] = set()  # the keys of `_in_flight` whose handler deferred its reply
        self._outbox: queue.SimpleQueue[tuple[bytes, bytes]] = queue.SimpleQueue()
        self._waker = Waker()
        self._post_lock = threading.Lock()
        self._closed = False
        self._peers: dict[bytes, _Peer] = {}
        self._by_client: dict[str, dict[bytes, None]] = {}  # client identity -> its peers' routing ids
        self._untracked: dict[bytes, None] = {}  # peers whose connection has no fd to follow (idle expiry)
        self._clock = time.monotonic()  # the socket thread's coarse clock: once per loop turn
        self._next_housekeep = self._clock + HOUSEKEEP_S
        self._next_idle_scan = self._clock
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
        self.dropped_hwm = 0  # replies dropped: the peer's send queue was full (it does not read)
        self.dropped_unroutable = 0  # replies dropped: the peer was gone
        self.refused_overloaded = 0  # calls refused: `max_in_flight` active calls
        self.refused_parked = 0  # deferred calls refused: `max_parked` parked calls
        self.unauthenticated = 0  # messages from a connection without (or with another) session
        self.hello_refused = 0  # Hellos refused (version, token, too many peers)
        self.peers_admitted = 0
        self.peers_goodbye = 0  # forgotten: the client said Goodbye
        self.peers_disconnected = 0  # forgotten: the connection closed
        self.peers_expired_idle = 0  # forgotten: untracked and silent for `peer_idle_s`
        self.goodbye_unknown = 0  # Goodbyes of peers already forgotten (their close overtook them)
        self.peers_evicted = 0  # forgotten: its client identity was at `max_peers_per_client`
        self.peers_unroutable = 0  # forgotten: a reply to it found its connection gone
        self.conns_dropped_no_hello = 0  # connections closed at their Hello deadline

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
                        first: zmq.Frame | None = sock.recv(copy=False)
                    except zmq.Again:
                        first = None
                    if first is not None:
                        self._read_socket(first)
                else:
                    # The timeout is a backstop for a lost wake-up and the housekeeping period; all work arrives as
                    # a poll event.
                    for item, _ in poller.poll(int(HOUSEKEEP_S * 1000)):
                        if item is sock:
                            self._read_socket()
                        else:
                            self._waker.drain()
                self._flush_outbox()
                now = self._clock = time.monotonic()
                if now >= self._next_housekeep:
                    self._housekeep(now)
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
        if self._mon is not None:
            try:
                self._sock.disable_monitor()
            except zmq.ZMQError:
                pass
            self._mon.close(linger=0)
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
            elif kind is m.Hello:
                self._on_hello(ident, msg, data_f)
            else:
                peer = self._peers.get(ident)
                if peer is None and kind is m.Goodbye:
                    # Already forgotten: its connection's close (the socket monitor) can overtake the Goodbye it
                    # sent just before. What the Goodbye asks is done; not a bad frame, and nobody reads a reply.
                    self.goodbye_unknown += 1
                elif peer is None or peer.session != msg.session:
                    self.unauthenticated += 1
                    self._frame_error(ident, "not_authenticated", f"{kind.__name__} without this connection's Hello")
                elif kind is m.Heartbeat:
                    peer.seen = self._clock
                    self._send(ident, _encode(m.HeartbeatAck(msg.seq)))
                elif kind is m.Cancel:
                    REGISTRY.cancel(msg.token)
                else:  # Goodbye: the client closes this socket
                    self.peers_goodbye += 1
                    self._forget(ident)

    def _on_hello(self, ident: bytes, msg: m.Hello, frame: zmq.Frame) -> None:
        fd = -1
        if self._mon is not None:
            fd = _frame_fd(frame)
            # First every connection event that happened before this Hello: a closed connection whose fd this one
            # reuses must be forgotten before this one is tied to the fd.
            self._drain_monitor()
        if msg.version != m.PROTOCOL_VERSION:
            reply: m.Wire = m.Refused("protocol_mismatch", m.version_mismatch_message(msg.version, m.PROTOCOL_VERSION))
        elif not hmac.compare_digest(msg.token.encode(), self._token.encode()):
            reply = m.Refused("bad_token", "the auth token does not match this cluster's (see its runtime dir)")
        else:
            reply = self._admit(ident, msg, fd)
        if type(reply) is m.Refused:
            self.errors += 1
            self.hello_refused += 1
            self._warn.warn("handshake_refused", code=reply.code, client=msg.client, client_version=msg.version)
        self._send(ident, _encode(reply))

    def _on_call(self, ident: bytes, msg: m.Call) -> None:
        body = msg.body
        peer = self._peers.get(ident)
        if peer is None or peer.session != msg.session:
            self.errors += 1
            self.unauthenticated += 1
            self._send(ident, _encode(m.Failed(msg.call_id, "not_authenticated", "HandshakeRequired", "send Hello")))
            return
        peer.seen = self._clock
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
        elif len(self._in_flight) - len(self._parked) > self._max_in_flight:  # parked waiters have their own bound
            self.refused_overloaded += 1
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
        except zmq.Again:  # its queue is at the high-water mark: a peer that does not read
            self.dropped += 1
            self.dropped_hwm += 1
        except zmq.ZMQError:  # peer gone (EHOSTUNREACH)
            self.dropped += 1
            self.dropped_unroutable += 1
            # Its connection is gone for good (clients take no chosen routing id: a reconnect is a new id). Most often
            # its close was reported already; but a Hello read after its connection closed (queued while this thread
            # was held up: a stalled tier) was admitted to no connection to follow, and would stay `peer_idle_s`.
            if self._peers.get(ident) is not None:
                self.peers_unroutable += 1
                self._forget(ident)

    def _flush_outbox(self) -> None:
        out = self._outbox
        while not out.empty():
            ident, data = out.get_nowait()
            self._send(ident, data)

    # ---- peers and connections (the socket thread) ----

    def _admit(self, ident: bytes, msg: m.Hello, fd: int) -> m.Wire:
        """A Hello with the right token: admit `ident` (Welcome) or refuse it (too many peers)."""
        old = self._peers.get(ident)
        if old is not None:
            self._forget(ident)  # a second Hello on one connection: admitted again below, with its new session
        else:
            siblings = self._by_client.get(msg.client)
            if siblings is not None and len(siblings) >= self._max_per_client:
                # This identity's least recently heard peer goes (a socket it leaked, most likely), not the new one.
                lru = min(siblings, key=lambda i: self._peers[i].seen)
                self.peers_evicted += 1
                self._warn.warn("peer_evicted", client=msg.client, limit=self._max_per_client)
                self._evict(lru)
            if len(self._peers) >= self._max_peers:
                self._expire_idle(self._clock)
            if len(self._peers) >= self._max_peers:
                return m.Refused("too_many_peers", f"{self._max_peers} peers already connected")
        session = msg.session or new_session()
        self._peers[ident] = _Peer(session, msg.client, fd, self._clock)
        self._by_client.setdefault(msg.client, {})[ident] = None
        self.peers_admitted += 1
        if fd >= 0:
            conn = self._conns.get(fd)
            if conn is None:  # accepted before the monitor's events could name it: follow it from here
                try:
                    conn = self._conns[fd] = _Conn(fd, os.fstat(fd).st_ino, self._clock)
                except OSError:
                    conn = None
            if conn is not None:
                if conn.ident is not None and conn.ident != ident:
                    self._forget_at(conn.fd, conn.ident)  # one connection, one routing id: that one is gone
                conn.ident = ident
            else:
                self._peers[ident].fd = -1
                self._untracked[ident] = None
        else:
            self._untracked[ident] = None
        return m.Welcome(m.PROTOCOL_VERSION, self.role, self.rank, self.pid, session)

    def _forget(self, ident: bytes) -> _Peer | None:
        """Drop a peer (its connection stays as it is); its calls in flight still get their replies, if routable."""
        peer = self._peers.pop(ident, None)
        if peer is None:
            return None
        siblings = self._by_client.get(peer.client)
        if siblings is not None:
            siblings.pop(ident, None)
            if not siblings:
                del self._by_client[peer.client]
        self._untracked.pop(ident, None)
        return peer

    def _forget_at(self, fd: int, ident: bytes) -> None:
        """The connection on `fd` closed: forget the peer it carried, if that peer is still tied to it."""
        peer = self._peers.get(ident)
        if peer is not None and peer.fd == fd:
            self.peers_disconnected += 1
            self._forget(ident)

    def _evict(self, ident: bytes) -> None:
        """Forget a peer and close its connection (when it is tracked)."""
        peer = self._forget(ident)
        if peer is not None and peer.fd >= 0:
            conn = self._conns.get(peer.fd)
            if conn is not None and conn.ident == ident:
                self._kill(conn)

    def _expire_idle(self, now: float) -> None:
        """Forget the untracked peers (no connection to follow) silent for `peer_idle_s`."""
        horizon = now - self._peer_idle
        for ident in [i for i in self._untracked if self._peers[i].seen < horizon]:
            self.peers_expired_idle += 1
            self._forget(ident)

    def _drain_monitor(self) -> None:
        """Apply the socket monitor's events (accepted and closed connections), in order."""
        mon = self._mon
        assert mon is not None
        while cast(int, mon.getsockopt(EVENTS)) & POLLIN:
            frames = mon.recv_multipart(NOBLOCK)
            if len(frames) < 2 or len(frames[0]) < _MON_HEAD.size:
                continue
            event, fd = _MON_HEAD.unpack_from(frames[0])
            if event == _ACCEPTED:
                self._on_accepted(fd)
            elif event == _DISCONNECTED:
                self._on_disconnected(fd)

    def _on_accepted(self, fd: int) -> None:
        if fd in self._conns:  # that fd's close was not reported: its connection is gone all the same
            self._on_disconnected(fd)
        try:
            ino = os.fstat(fd).st_ino
        except OSError:  # closed already: its DISCONNECTED event follows
            return
        conn = self._conns[fd] = _Conn(fd, ino, self._clock + self._hello_deadline)
        if self._hello_deadline > 0:
            self._pending_hello.append(conn)

    def _on_disconnected(self, fd: int) -> None:
        conn = self._conns.pop(fd, None)
        if conn is not None and conn.ident is not None:
            self._forget_at(fd, conn.ident)

    def _kill(self, conn: _Conn) -> None:
        """Close a tracked connection: shut its socket down (ZeroMQ then drops the connection and reports it)."""
        if self._conns.get(conn.fd) is conn:
            del self._conns[conn.fd]
        try:
            if os.fstat(conn.fd).st_ino != conn.ino:
                return  # that connection is gone and its fd is another file now
            s = _socket.socket(fileno=conn.fd)
            try:
                s.shutdown(_socket.SHUT_RDWR)
            finally:
                s.detach()  # the fd stays ZeroMQ's
        except OSError:
            pass

    def _housekeep(self, now: float) -> None:
        """Every `HOUSEKEEP_S` on the socket thread: connection events, Hello deadlines, idle expiry."""
        self._next_housekeep = now + HOUSEKEEP_S
        if self._mon is not None:
            self._drain_monitor()
            pending = self._pending_hello
            while pending and pending[0].deadline <= now:
                conn = pending.popleft()
                if conn.ident is None and self._conns.get(conn.fd) is conn:
                    self.conns_dropped_no_hello += 1
                    self._kill(conn)
        if self._untracked and now >= self._next_idle_scan:
            self._next_idle_scan = now + min(1.0, self._peer_idle)
            self._expire_idle(now)

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
        else:
            self._park(ctx)

    def _park(self, ctx: CallContext) -> None:
        """The handler deferred its reply: the call now counts against `max_parked`, not `max_in_flight`."""
        key = ctx._key
        if len(self._parked) >= self._max_parked:
            self.refused_parked += 1
            self._reply_exc(ctx, HandlerError("overloaded", f"{self._max_parked} deferred calls already parked"))
            return
        self._parked.add(key)
        if key not in self._in_flight:  # answered meanwhile (by another thread): `_finish` may have looked already
            self._parked.discard(key)

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
            if self._parked:
                self._parked.discard(ctx._key)
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
            if self._parked:
                self._parked.discard(ctx._key)
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
            "parked": len(self._parked),
            "conns_tracked": len(self._conns),
            "conns_awaiting_hello": sum(1 for c in list(self._conns.values()) if c.ident is None),
            "dropped_hwm": self.dropped_hwm,
            "dropped_unroutable": self.dropped_unroutable,
            "refused_overloaded": self.refused_overloaded,
            "refused_parked": self.refused_parked,
            "unauthenticated": self.unauthenticated,
            "hello_refused": self.hello_refused,
            "peers_admitted": self.peers_admitted,
            "peers_goodbye": self.peers_goodbye,
            "peers_disconnected": self.peers_disconnected,
            "peers_expired_idle": self.peers_expired_idle,
            "goodbye_unknown": self.goodbye_unknown,
            "peers_evicted": self.peers_evicted,
            "peers_unroutable": self.peers_unroutable,
            "conns_dropped_no_hello": self.conns_dropped_no_hello,
        }
