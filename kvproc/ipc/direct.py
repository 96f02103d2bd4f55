"""Blocking calls on a socket owned by the calling thread: the fast path behind `RpcClient.request`.

A call through the client's I/O thread costs two extra thread wake-ups (caller -> I/O thread -> caller), which on
a busy 2-core host doubles a ZeroMQ round trip. A thread that blocks for its reply anyway can own a socket itself:
each such thread gets its own DEALER (created and handshaken on first use, then reused; closed when the thread ends,
through a finalizer on an object only that thread's locals hold), sends, and sleeps in a blocking receive on that
socket, as a raw ZeroMQ client does, in slices of at most `DEATH_CHECK_MS` (a `zmq_poll` of the socket and the
client's death fd cost ~10-15 us more wall time per reply and twice the CPU time; `_wait`). A wait that a cancel token
may end polls the socket with the token's eventfd and the death fd instead. One thread still owns each socket;
nothing is shared but the death fd.

Guarantees are the I/O thread path's: exactly one outcome (the reply, PeerDead, or a local deadline backstop);
`mark_dead` wakes every blocked caller: a polling one at once (the death fd), a receiving one at its slice's end (at
most `DEATH_CHECK_MS` later); a `Goodbye` seen here marks the
whole client dead; a cancelled token sends `Cancel` through the I/O thread (the server's cancel registry is per
process, so any connection may carry it). Replies to an earlier call that timed out locally are recognised by call
id and dropped.

A fire-and-forget call from a thread that already owns a socket (`oneway`: a resolve releasing its lease as its last
step) is one send on that socket, with no I/O-thread wake-up, whose GIL and CPU time would land on the resolve's
next steps; its reply is read, and handed to its callback, during the thread's next call on the socket, or when the
socket closes (the thread ended, or the client closed): then its pending replies are waited for, at most
`ONEWAY_SETTLE_S` (a release sent as a thread's last act is answered within a round trip; calling it "unread" would
log a failure that did not happen); what still has no reply then is reported as PeerDead "closed before the reply
was read".

A caller that must stop waiting before the call's own deadline but still needs its outcome (a resolve whose deadline
passes during a copy order, which is not cancellable and keeps its destination reserved until it ends) passes
`wait_until` and `on_late`: if no reply has come by `wait_until`, the thread gives the socket up -- it is handed,
with the one call pending on it, to a reaper thread that waits for that reply (or the peer's death, or the call's
deadline backstop), hands it to `on_late` and closes the socket -- and the caller's next call opens a new one. With a
cancel token, cancelling it ends such a wait at once the same way.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any, Callable, cast

import msgspec
import structlog
import zmq

from kvproc.ipc import messages as m
from kvproc.ipc.errors import HandshakeRefused, PeerDeadError
from kvproc.ipc.sockets import EVENTS, GOODBYE_LINGER_MS, NOBLOCK, POLLIN, configure_socket, new_session
from kvproc.ipc.undecodable import failed_for

if TYPE_CHECKING:
    from kvproc.ipc.cancel import CancelToken
    from kvproc.ipc.client import RpcClient

log = structlog.get_logger(__name__)
_TERMINAL = (m.Ok, m.Failed, m.Cancelled, m.PeerDead)
ONEWAY_SETTLE_S = 0.5  # how long a closing socket waits for the replies of its fire-and-forget calls
# The longest a blocking receive sleeps before it looks at the client's death mark and the deadline again (`_wait`).
DEATH_CHECK_MS = 50


class _Late:
    """The `request` result when the caller stopped waiting at `wait_until`: the outcome goes to `on_late`."""

    def __repr__(self) -> str:
        return "LATE"


LATE = _Late()
_GONE = object()  # `_read`: the peer said Goodbye


class _Owned:
    __slots__ = ("sock", "poller", "busy", "oneways", "on_thread_exit", "rcvtimeo", "session")

    def __init__(self, sock: zmq.Socket[Any], poller: zmq.Poller) -> None:
        self.sock, self.poller, self.busy = sock, poller, False
        self.session = new_session()  # this socket's session id: its every message carries it (`messages.py`)
        self.rcvtimeo = -1  # the socket's ZMQ_RCVTIMEO as last set (ms; -1: ZeroMQ's default, block)
        self.oneways: dict[int, Callable[[Any], None]] = {}  # fire-and-forget calls whose reply is not read yet
        self.on_thread_exit: weakref.finalize[Any, Any] | None = None


class _ThreadKeeper:
    """Lives only in the owning thread's `threading.local`: when the thread ends, its locals go and this object's
    finalizer closes the thread's socket (a thread per request must not leave a socket per request behind)."""

    __slots__ = ("__weakref__",)


def _thread_gone(calls_ref: weakref.ref[DirectCalls], owned: _Owned) -> None:
    calls = calls_ref()
    if calls is not None and not owned.busy and not owned.sock.closed:  # busy: a reaper owns it and closes it
        calls._drop(owned)


class DirectCalls:
    def __init__(self, client: RpcClient, context: zmq.Context[Any], hwm: int) -> None:
        self._client = client
        self._ctx = context
        self._hwm = hwm
        self._local = threading.local()
        self._lock = threading.Lock()
        self._owned: list[_Owned] = []
        self._closed = False
        self.death_fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        self._decoder = m.client_decoder()  # msgspec decoders are thread-safe

    def signal_death(self) -> None:
        with self._lock:
            if self.death_fd >= 0:
                os.eventfd_write(self.death_fd, 1)  # never drained: stays readable for every poller

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle = [o for o in self._owned if not o.busy]  # a busy socket is closed by its own thread on the way out
            for owned in idle:
                owned.busy = True  # claimed: its thread's exit finalizer leaves it to this close
        until = time.monotonic() + ONEWAY_SETTLE_S  # one bound for all of them, not one per socket
        for owned in idle:
            self._settle_oneways(owned, until)  # outside the lock: no other path touches a claimed socket
        with self._lock:
            for owned in idle:
                if owned.oneways:
                    self._drain_ready(owned, closing=True)  # replies that did arrive are delivered, not "unread"
                _close(owned, goodbye=True)
                owned.busy = False
            self._owned = [o for o in self._owned if o not in idle]
            self._release_fd()
        for owned in idle:
            _unread(owned)

    def _settle_oneways(self, owned: _Owned, until: float) -> None:
        """Before a socket closes: read the replies of its fire-and-forget calls as they arrive, until none is
        pending, `until` passes, the peer dies or says goodbye."""
        sock = owned.sock
        while owned.oneways and self._client._dead is None:
            if cast(int, sock.getsockopt(EVENTS)) & POLLIN:
                if self._read(owned, closing=True) is _GONE:
                    return
                continue
            left = until - time.monotonic()
            if left <= 0:
                return
            events = owned.poller.poll(int(left * 1000) + 1)
            if events and (len(events) > 1 or events[0][0] is not sock):
                return  # the death fd

    def _release_fd(self) -> None:
        # Under self._lock. The death fd is closed by whoever is last: close() or the last busy caller.
        if not self._owned and self.death_fd >= 0:
            os.close(self.death_fd)
            self.death_fd = -1

    def _socket(self, deadline: float) -> _Owned | None:
        owned: _Owned | None = getattr(self._local, "owned", None)
        if owned is not None and not self._closed:
            return owned
        with self._lock:
            if self._closed:
                return None
            sock = self._ctx.socket(zmq.DEALER)
            configure_socket(sock, hwm=self._hwm)
        poller = zmq.Poller()
        poller.register(sock, POLLIN)
        poller.register(self.death_fd, POLLIN)
        owned = _Owned(sock, poller)
        sock.connect(self._client.endpoint)
        # The threads' sockets of one process share a client identity: the server bounds their number (and evicts
        # the least recently used past it), so a process that leaks them cannot lock others out.
        name = f"{self._client.name}/thread@{os.getpid()}"
        sock.send(m.encode(m.Hello(m.PROTOCOL_VERSION, self._client._token, name, owned.session)))
        reply = self._wait(owned, 0, min(deadline, time.monotonic() + 5.0))
        if type(reply) is m.Refused:
            sock.close(linger=0)
            raise HandshakeRefused(reply.code, reply.message)
        if reply is None:
            sock.close(linger=0)
            return None  # timed out or died: the caller reports it
        with self._lock:
            if self._closed:
                _close(owned, goodbye=True)
                return None
            self._owned.append(owned)
        keeper = _ThreadKeeper()
        owned.on_thread_exit = weakref.finalize(keeper, _thread_gone, weakref.ref(self), owned)
        self._local.owned, self._local.keeper = owned, keeper
        return owned

    def _wait(self, owned: _Owned, call_id: int, deadline: float, polled: bool = False) -> Any:
        """Wait until the terminal reply to `call_id` (0: the handshake reply) arrives; None if the client dies or
        the deadline passes.

        Without `polled` the thread sleeps in a blocking receive of at most `DEATH_CHECK_MS` at a time (module
        docstring): a peer declared dead is noticed within that slice. `polled`: poll the socket with the fds
        registered on the poller (the death fd, and a cancel token's eventfd: a cancel must end the wait at once)."""
        sock = owned.sock
        while True:
            # Read what is already there first (ZMQ_EVENTS: no poll syscall, and no zmq.Again exception, which costs
            # tens of microseconds to build); wait only when nothing is waiting.
            if not cast(int, sock.getsockopt(EVENTS)) & POLLIN:
                left = deadline - time.monotonic()
                if left <= 0 or self._client._dead is not None:
                    return None
                if not polled:
                    timeout_ms = DEATH_CHECK_MS if left * 1000 >= DEATH_CHECK_MS else int(left * 1000) + 1
                    if timeout_ms != owned.rcvtimeo:
                        sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
                        owned.rcvtimeo = timeout_ms
                    try:
                        data = sock.recv()
                    except zmq.Again:  # the slice passed: look at the deadline and the death mark again
                        continue
                    msg = self._decode(owned, data)
                else:
                    events = owned.poller.poll(int(left * 1000) + 1)
                    if not events:
                        continue
                    if len(events) > 1 or events[0][0] is not sock:
                        return None  # the death fd
                    continue
            else:
                msg = self._read(owned)
            if msg is _GONE:
                return None
            kind = type(msg)
            if call_id:
                if kind in _TERMINAL and msg.call_id == call_id:
                    return msg
            elif kind is m.Welcome or kind is m.Refused:
                return msg

    def _read(self, owned: _Owned, closing: bool = False) -> Any:
        """One waiting frame, decoded: None when it was consumed here (unreadable, or a oneway's reply handed to its
        callback), `_GONE` on the peer's Goodbye (the client is marked dead unless `closing`: under `self._lock`,
        which marking takes), else the message."""
        return self._decode(owned, owned.sock.recv(NOBLOCK), closing)

    def _decode(self, owned: _Owned, data: bytes, closing: bool = False) -> Any:
        """`_read` of a frame already received."""
        try:
            msg = self._decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self._client.frame_errors += 1
            msg = failed_for(data, e, self._client.peer)  # its call (or oneway) ends now, typed
            if msg is None:  # not even its call id could be read
                return None
        kind = type(msg)
        if kind is m.Goodbye:
            if not closing:
                self._client.mark_dead(f"{self._client.peer}: said goodbye: {msg.reason}")
            return _GONE
        if kind in _TERMINAL and owned.oneways:
            done = owned.oneways.pop(msg.call_id, None)
            if done is not None:
                _report(done, msg)
                return None
        return msg

    def request(self, msg: m.RequestBody, deadline: float, token: CancelToken | None,
                wait_until: float | None = None, on_late: Callable[[Any], None] | None = None,
                overlap: Callable[[], None] | None = None, wake_on: CancelToken | None = None) -> Any:
        """One terminal reply (a Reply struct); None when this path cannot be used (caller falls back, and `overlap`
        has not run); `LATE` when `wait_until` passed first and `on_late` will receive the reply (see the module
        docstring). `overlap` runs once the request is on its way, before the wait: work that fills the round
        trip (it must not raise). `wake_on`: a token that ends a `wait_until` wait without being sent to the server
        (a call that cannot be taken back, e.g. a copy order, is still waited out by the reaper)."""
        client = self._client
        # A new socket's handshake waits no longer than the caller does (a hung peer: the I/O-thread path then
        # returns LATE at once).
        owned = self._socket(min(deadline, wait_until) if on_late is not None and wait_until is not None else deadline)
        if owned is None:
            return None
        with self._lock:  # against a concurrent close(): a socket marked busy is never closed under its owner
            if self._closed:
                return None
            owned.busy = True
        call_id = next(client._ids)
        listener = client._send_cancel if token is not None else None
        late = False
        try:
            data = m.encode(m.Call(call_id, int(deadline * 1e9), msg, token.id if token is not None else 0,
                                   owned.session))
            owned.sock.send(data)
            if token is not None and not token.add_listener(client._send_cancel):
                client._send_cancel(token.id)
            if overlap is not None:
                overlap()
            if on_late is not None and wait_until is not None and wait_until < deadline:
                reply = self._wait_or_cancel(owned, call_id, wait_until, wake_on or token)
                late = reply is None and client._dead is None and not self._closed
            else:
                reply = self._wait(owned, call_id, deadline + client._grace)
        finally:
            if late:
                if owned.on_thread_exit is not None:
                    owned.on_thread_exit.detach()  # the reaper closes it now, not this thread's exit
                self._local.owned = self._local.keeper = None  # the socket goes to the reaper, call and all
            else:
                owned.busy = False
                if token is not None:
                    token.remove_listener(listener)  # type: ignore[arg-type]
                if self._closed:
                    self._drop(owned)
        if late:
            assert on_late is not None
            threading.Thread(target=self._reap, args=(owned, call_id, deadline, token, listener, on_late),
                             name=f"kvproc-late-{client.peer}", daemon=True).start()
            return LATE
        if reply is not None:
            return reply
        return self._no_reply(call_id)

    def _wait_or_cancel(self, owned: _Owned, call_id: int, until: float, token: CancelToken | None) -> Any:
        """`_wait` that also stops when `token` is cancelled (a caller that may give up on a call it cannot take
        back: its reply then goes to `on_late`). The token's listener writes an eventfd polled with the socket."""
        if token is None:
            return self._wait(owned, call_id, until)
        efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        lock = threading.Lock()
        open_ = [True]

        def wake(_token_id: int) -> None:  # any thread (the canceller's)
            with lock:
                if open_[0]:
                    os.eventfd_write(efd, 1)

        if not token.add_listener(wake):
            os.close(efd)
            return None  # cancelled already
        owned.poller.register(efd, POLLIN)
        try:
            return self._wait(owned, call_id, until, polled=True)
        finally:
            owned.poller.unregister(efd)
            token.remove_listener(wake)
            with lock:
                open_[0] = False
                os.close(efd)

    def oneway(self, msg: m.RequestBody, deadline: float, on_reply: Callable[[Any], None]) -> bool:
        """Send a fire-and-forget call on this thread's socket, if it has one (False: use the I/O thread). Its
        terminal reply goes to `on_reply` when this thread next reads the socket (module docstring)."""
        owned: _Owned | None = getattr(self._local, "owned", None)
        if owned is None or self._closed or self._client._dead is not None:
            return False
        if owned.oneways:
            self._drain_ready(owned)  # a thread that only sends oneways still reads (and reports) their replies
        call_id = next(self._client._ids)
        owned.oneways[call_id] = on_reply
        try:
            owned.sock.send(m.encode(m.Call(call_id, int(deadline * 1e9), msg, 0, owned.session)), NOBLOCK)
        except zmq.ZMQError:  # at the high-water mark (or closing): the I/O thread path reports it
            owned.oneways.pop(call_id, None)
            return False
        return True

    def _drain_ready(self, owned: _Owned, closing: bool = False) -> None:
        """Hand the replies already waiting on the socket to their oneway callbacks (no wait); others are dropped."""
        while cast(int, owned.sock.getsockopt(EVENTS)) & POLLIN:
            if self._read(owned, closing) is _GONE:
                return

    def _no_reply(self, call_id: int) -> Any:
        client = self._client
        if client._dead is not None:
            return m.PeerDead(call_id, client._dead)
        return m.Failed(call_id, "deadline_exceeded", "DeadlineExceeded", f"{client.peer}: no reply (local backstop)")

    def _reap(self, owned: _Owned, call_id: int, deadline: float, token: CancelToken | None,
              listener: Callable[[int], None] | None, on_late: Callable[[Any], None]) -> None:
        """A late call's own thread: wait for its one outcome, hand it over, close the socket."""
        try:
            reply = self._wait(owned, call_id, deadline + self._client._grace)
            outcome = reply if reply is not None else self._no_reply(call_id)
        finally:
            if token is not None:
                token.remove_listener(listener)  # type: ignore[arg-type]
            self._drop(owned)
        on_late(outcome)

    def _drop(self, owned: _Owned) -> None:
        """Close a socket its thread no longer uses (the thread ended, the client closed under it, or a late call
        settled), once its fire-and-forget replies are read (bounded)."""
        self._settle_oneways(owned, time.monotonic() + ONEWAY_SETTLE_S)
        with self._lock:
            owned.busy = False
            if owned.oneways:
                self._drain_ready(owned, closing=True)
            _close(owned, goodbye=self._client._dead is None or self._closed)
            if owned in self._owned:
                self._owned.remove(owned)
            if self._closed:
                self._release_fd()
        _unread(owned)


def _close(owned: _Owned, goodbye: bool) -> None:
    """Close an admitted socket; with `goodbye`, first tell the server to forget it (its connection closes too, which
    the server notices on its own, a little later)."""
    if goodbye:
        try:
            owned.sock.send(m.encode(m.Goodbye("socket closed", owned.session)), NOBLOCK)
        except zmq.ZMQError:
            goodbye = False
    owned.sock.close(linger=GOODBYE_LINGER_MS if goodbye else 0)


def _report(done: Callable[[Any], None], reply: Any) -> None:
    try:
        done(reply)
    except Exception:  # a callback's bug must not break the caller's wait
        log.exception("oneway_callback_failed")


def _unread(owned: _Owned) -> None:
    """The socket closed with fire-and-forget replies unread: each reports PeerDead (its effect is unknown)."""
    oneways, owned.oneways = owned.oneways, {}
    for call_id, done in oneways.items():
        _report(done, m.PeerDead(call_id, "socket closed before the reply was read"))


__all__ = ["LATE", "DirectCalls", "PeerDeadError"]
