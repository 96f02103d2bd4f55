"""Cancellation tokens that cross processes.

A caller creates a `CancelToken` and passes it with its calls; the call carries only the token's id. Cancelling the
token sends `Cancel(id)` to every peer that has a pending call with it. A server looks the id up in its process's
`REGISTRY`: every handler working under that id observes the cancellation between operations, and any call that
handler made to a further peer with the same token is cancelled there too (the registry fires the token's
listeners), so a cancellation reaches every process working on the request.

A `Cancel` can overtake the `Call` it cancels (different sockets or threads): the registry remembers recently
cancelled ids that had no live token (bounded), and a later `acquire` of such an id starts out cancelled.
"""

from __future__ import annotations

import random
import threading
from collections import OrderedDict
from typing import Callable

from kvproc.ipc.errors import CallCancelled

Listener = Callable[[int], None]


class CancelToken:
    __slots__ = ("id", "_event", "_lock", "_listeners")

    def __init__(self, token_id: int | None = None) -> None:
        # 63 random bits: unique across processes without coordination; 0 means "no token" on the wire.
        self.id = token_id if token_id is not None else random.getrandbits(63) | 1
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._listeners: list[Listener] = []

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> None:
        with self._lock:
            if self._event.is_set():
                return
            self._event.set()
            listeners, self._listeners = self._listeners, []
        for fn in listeners:
            fn(self.id)

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout` seconds, waking early on cancellation; True if cancelled."""
        return self._event.wait(timeout)

    def check(self) -> None:
        if self._event.is_set():
            raise CallCancelled(self.id)

    def add_listener(self, fn: Listener) -> bool:
        """Call `fn(id)` once when cancelled; returns False (and does not register) if already cancelled."""
        with self._lock:
            if self._event.is_set():
                return False
            self._listeners.append(fn)
            return True

    def remove_listener(self, fn: Listener) -> None:
        with self._lock:
            try:
                self._listeners.remove(fn)
            except ValueError:
                pass

    def __repr__(self) -> str:
        return f"CancelToken({self.id:#x}, cancelled={self.cancelled})"


class CancelRegistry:
    """Process-wide map id -> live token, refcounted by the calls working under it."""

    def __init__(self, remember: int = 4096) -> None:
        self._lock = threading.Lock()
        self._live: dict[int, tuple[CancelToken, int]] = {}
        self._recent: OrderedDict[int, None] = OrderedDict()
        self._remember = remember

    def acquire(self, token_id: int) -> CancelToken:
        with self._lock:
            entry = self._live.get(token_id)
            if entry is not None:
                self._live[token_id] = (entry[0], entry[1] + 1)
                return entry[0]
            token = CancelToken(token_id)
            self._live[token_id] = (token, 1)
            early = token_id in self._recent
        if early:
            token.cancel()
        return token

    def release(self, token: CancelToken) -> None:
        with self._lock:
            entry = self._live.get(token.id)
            if entry is None:
                return
            if entry[1] <= 1:
                del self._live[token.id]
            else:
                self._live[token.id] = (entry[0], entry[1] - 1)

    def register(self, token: CancelToken) -> None:
        """Make a locally created token findable by id (e.g. a role that forwards work under its own token)."""
        with self._lock:
            entry = self._live.get(token.id)
            self._live[token.id] = (token, (entry[1] if entry else 0) + 1)

    def cancel(self, token_id: int) -> bool:
        """Cancel the live token with this id; remember the id if none is live. True if a live token was hit."""
        with self._lock:
            entry = self._live.get(token_id)
            if entry is None:
                self._recent[token_id] = None
                while len(self._recent) > self._remember:
                    self._recent.popitem(last=False)
                return False
        entry[0].cancel()
        return True

    def live_count(self) -> int:
        return len(self._live)


REGISTRY = CancelRegistry()


def new_token() -> CancelToken:
    return CancelToken()
