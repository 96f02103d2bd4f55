"""The per-call context a handler receives: deadline, cancel token, and the one-shot reply.

A handler either returns its payload (the server replies `Ok`) or raises (the server replies `Failed` or
`Cancelled`), or returns `ctx.defer()` and later calls exactly one of `ok` / `fail` / `cancelled` from any thread
(a delayed reply is also how a server pushes a notification: the caller's pending call is the subscription).
The first reply wins; later ones are ignored and counted, so a call can never get two terminal replies.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from kvproc.ipc.cancel import CancelToken
from kvproc.ipc.errors import CallCancelled, DeadlineExceeded

if TYPE_CHECKING:
    from kvproc.ipc.server import RpcServer


class Deferred:
    """Returned by a handler that will reply later through its context."""

    __slots__ = ()


DEFERRED = Deferred()


class CallContext:
    __slots__ = ("call_id", "peer", "deadline_ns", "token", "_server", "_key")

    def __init__(
        self, server: RpcServer, peer: bytes, call_id: int, deadline_ns: int, token: CancelToken | None
    ) -> None:
        self._server = server
        self.peer = peer
        self.call_id = call_id
        self.deadline_ns = deadline_ns
        self.token = token
        self._key = (peer, call_id)

    # ---- observing deadline and cancellation (call between operations) ----

    def remaining(self) -> float:
        """Seconds left before the deadline (negative once past)."""
        return (self.deadline_ns - time.monotonic_ns()) / 1e9

    @property
    def cancelled(self) -> bool:
        return self.token is not None and self.token.cancelled

    def check(self) -> None:
        """Raise `CallCancelled` or `DeadlineExceeded`; call between operations of a long handler."""
        if self.token is not None and self.token.cancelled:
            raise CallCancelled(self.token.id)
        if time.monotonic_ns() >= self.deadline_ns:
            raise DeadlineExceeded(f"deadline passed {-self.remaining():.3f}s ago")

    def sleep(self, seconds: float) -> None:
        """Wait up to `seconds` (capped at the deadline), waking at once on cancellation, then `check()`."""
        wait = max(0.0, min(seconds, self.remaining()))
        if self.token is not None:
            self.token.wait(wait)
        else:
            time.sleep(wait)
        self.check()

    # ---- replying (exactly once) ----

    def defer(self) -> Deferred:
        return DEFERRED

    def ok(self, payload: Any) -> bool:
        return self._server._reply_ok(self, payload)

    def fail(self, exc: BaseException) -> bool:
        return self._server._reply_exc(self, exc)

    @property
    def done(self) -> bool:
        return self._key not in self._server._in_flight
