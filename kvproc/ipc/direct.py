"""Blocking calls on a socket owned by the calling thread: the fast path behind `RpcClient.request`.

A call through the client's I/O thread costs two extra thread wake-ups (caller -> I/O thread -> caller), which on
a busy 2-core host doubles a ZeroMQ round trip. A thread that blocks for its reply anyway can own a socket itself:
each such thread gets its own DEALER (created and handshaken on first use, then reused), sends, and polls that socket
together with the client's death fd. One thread still owns each socket; nothing is shared but the death fd.

Guarantees are the I/O thread path's: exactly one outcome (the reply, PeerDead, or a local deadline backstop);
`mark_dead` makes the death fd readable, which wakes every blocked caller at once; a `Goodbye` seen here marks the
whole client dead; a cancelled token sends `Cancel` through the I/O thread (the server's cancel registry is per
process, so any connection may carry it). Replies to an earlier call that timed out locally are recognised by call
id and dropped.
"""

from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from kvproc.ipc import messages as m
from kvproc.ipc.errors import HandshakeRefused, PeerDeadError
from kvproc.ipc.sockets import configure_socket

if TYPE_CHECKING:
    from kvproc.ipc.cancel import CancelToken
    from kvproc.ipc.client import RpcClient

_TERMINAL = (m.Ok, m.Failed, m.Cancelled, m.PeerDead)


class _Owned:
    __slots__ = ("sock", "poller", "busy")

    def __init__(self, sock: zmq.Socket[Any], poller: zmq.Poller) -> None:
        self.sock, self.poller, self.busy = sock, poller, False


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
            for owned in self._owned:
                if not owned.busy:  # a busy socket is closed by its own thread on the way out
                    owned.sock.close(linger=0)
            self._owned = [o for o in self._owned if o.busy]
            self._release_fd()

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
        poller.register(sock, zmq.POLLIN)
        poller.register(self.death_fd, zmq.POLLIN)
        owned = _Owned(sock, poller)
        sock.connect(self._client.endpoint)
        sock.send(m.encode(m.Hello(m.PROTOCOL_VERSION, self._client._token, f"{self._client.name}/thread")))
        reply = self._wait(owned, 0, min(deadline, time.monotonic() + 5.0))
        if type(reply) is m.Refused:
            sock.close(linger=0)
            raise HandshakeRefused(reply.code, reply.message)
        if reply is None:
            sock.close(linger=0)
            return None  # timed out or died: the caller reports it
        with self._lock:
            if self._closed:
                sock.close(linger=0)
                return None
            self._owned.append(owned)
        self._local.owned = owned
        return owned

    def _wait(self, owned: _Owned, call_id: int, deadline: float) -> Any:
        """Poll until the terminal reply to `call_id` (0: the handshake reply) arrives; None if the client dies or
        the deadline passes."""
        sock = owned.sock
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or self._client._dead is not None:
                return None
            events = owned.poller.poll(int(left * 1000) + 1)
            if not events:
                continue
            if len(events) > 1 or events[0][0] is not sock:
                return None  # the death fd
            while True:
                try:
                    frame = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    msg = self._decoder.decode(frame)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    self._client.frame_errors += 1
                    continue
                if type(msg) is m.Goodbye:
                    self._client.mark_dead(f"{self._client.peer}: said goodbye: {msg.reason}")
                    return None
                kind = type(msg)
                if call_id:
                    if kind in _TERMINAL and msg.call_id == call_id:
                        return msg
                elif kind is m.Welcome or kind is m.Refused:
                    return msg

    def request(self, msg: m.RequestBody, deadline: float, token: CancelToken | None) -> Any:
        """One terminal reply (a Reply struct), or None when this path cannot be used (caller falls back)."""
        client = self._client
        owned = self._socket(deadline)
        if owned is None:
            return None
        with self._lock:  # against a concurrent close(): a socket marked busy is never closed under its owner
            if self._closed:
                return None
            owned.busy = True
        call_id = next(client._ids)
        listener = client._send_cancel if token is not None else None
        try:
            data = m.encode(m.Call(call_id, int(deadline * 1e9), msg, token.id if token is not None else 0))
            owned.sock.send(data)
            if token is not None and not token.add_listener(client._send_cancel):
                client._send_cancel(token.id)
            reply = self._wait(owned, call_id, deadline + client._grace)
        finally:
            owned.busy = False
            if token is not None:
                token.remove_listener(listener)  # type: ignore[arg-type]
            if self._closed:
                with self._lock:
                    owned.sock.close(linger=0)
                    if owned in self._owned:
                        self._owned.remove(owned)
                    self._release_fd()
        if reply is not None:
            return reply
        if client._dead is not None:
            return m.PeerDead(call_id, client._dead)
        return m.Failed(call_id, "deadline_exceeded", "DeadlineExceeded", f"{client.peer}: no reply (local backstop)")


__all__ = ["DirectCalls", "PeerDeadError"]
