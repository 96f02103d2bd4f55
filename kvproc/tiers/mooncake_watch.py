"""`KeyWatch`: the keys a host tier's full-hit waiters wait on, re-probed in Mooncake until they land there.

A decode node's full-hit resolve (a P/D hand-off from another node) that misses waits on its own host tier for the
chain's last page (`WaitKey`). The producer's pages never reach this node's host tier by themselves: they land in
Mooncake (the producer's write-through), and only a query pulls them here. So while such a wait is parked, its key
is asked of Mooncake again on a backoff (`FIRST_S` doubling to `MAX_S`, never past the wait's deadline): once it is
there (the page and its required artifacts), the waiter is answered and the resolve queries again, which pulls it.

Bounded: at most `max_keys` keys watched (more are refused, counted: those waiters get the host tier's own wait);
one batched existence check in flight at a time for all the keys due; a key is dropped at its deadline, once found,
or once nobody waits on it any more. One thread, which sleeps until the next key is due (never polls).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import structlog

log = structlog.get_logger("kvproc.mooncake")

FIRST_S = 0.02  # the first re-probe: a write-through of a few pages takes milliseconds on a fast network
MAX_S = 0.5  # the backoff's cap: a wait of 15 s costs at most ~35 existence checks of one key


@dataclass
class _Watched:
    deadline: float  # monotonic seconds: the latest waiter's deadline
    backoff: float


# probe(keys, done): ask Mooncake which of `keys` it holds in full; `done(found)` is called exactly once.
Probe = Callable[[list[bytes], Callable[[set[bytes]], None]], None]


class KeyWatch:
    def __init__(self, probe: Probe, found: Callable[[bytes], None], wanted: Callable[[bytes], bool],
                 counters: Counter[str], *, max_keys: int = 1024) -> None:
        """`found(key)` answers the key's waiters; `wanted(key)` says whether anyone still waits on it. Both are
        called from this watch's threads, never under its lock."""
        self._probe, self._found, self._wanted = probe, found, wanted
        self.counters = counters
        self.max_keys = max_keys
        self._keys: dict[bytes, _Watched] = {}
        self._due: list[tuple[float, int, bytes]] = []  # (when, seq, key); stale rows are skipped
        self._seq = itertools.count()
        self._cv = threading.Condition()
        self._in_flight = False
        self._closed = False
        self._thread = threading.Thread(target=self._main, name="kvproc-mooncake-watch", daemon=True)
        self._thread.start()

    def watch(self, key: bytes, deadline: float) -> bool:
        """Re-probe `key` until `deadline` (monotonic seconds). False: refused (the watch is full, or closed)."""
        with self._cv:
            if self._closed:
                return False
            w = self._keys.get(key)
            if w is not None:
                w.deadline = max(w.deadline, deadline)
                return True
            if len(self._keys) >= self.max_keys:
                self.counters["watch_refused_full"] += 1
                return False
            self._keys[key] = _Watched(deadline, FIRST_S)
            heapq.heappush(self._due, (time.monotonic() + FIRST_S, next(self._seq), key))
            self.counters["watch_keys"] += 1
            self._cv.notify()
            return True

    @property
    def watching(self) -> int:
        return len(self._keys)

    def _main(self) -> None:
        while True:
            with self._cv:
                while not self._closed and (self._in_flight or not self._due
                                            or self._due[0][0] > time.monotonic()):
                    wait = None if self._in_flight or not self._due else self._due[0][0] - time.monotonic()
                    self._cv.wait(wait)
                if self._closed:
                    return
                now = time.monotonic()
                due: list[bytes] = []
                while self._due and self._due[0][0] <= now:
                    key = heapq.heappop(self._due)[2]
                    w = self._keys.get(key)
                    if w is None or key in due:
                        continue
                    if now >= w.deadline:
                        del self._keys[key]
                        self.counters["watch_expired"] += 1
                        continue
                    due.append(key)
            due = [k for k in due if self._still_wanted(k)]
            if not due:
                continue
            with self._cv:
                self._in_flight = True
            self.counters["watch_probes"] += 1
            try:
                self._probe(due, functools.partial(self._probed, due))
            except Exception:
                log.exception("mooncake_watch_probe_failed", keys=len(due))
                self._probed(due, set())

    def _still_wanted(self, key: bytes) -> bool:
        if self._wanted(key):
            return True
        with self._cv:
            if self._keys.pop(key, None) is not None:
                self.counters["watch_abandoned"] += 1  # its waiters were answered (the key landed here) or left
        return False

    def _probed(self, due: list[bytes], found: set[bytes]) -> None:
        hits: list[bytes] = []
        with self._cv:
            self._in_flight = False
            now = time.monotonic()
            for key in due:
                w = self._keys.get(key)
                if w is None:
                    continue
                if key in found:
                    del self._keys[key]
                    hits.append(key)
                    continue
                w.backoff = min(w.backoff * 2, MAX_S)
                heapq.heappush(self._due, (min(now + w.backoff, w.deadline), next(self._seq), key))
            self._cv.notify()
        self.counters["watch_found"] += len(hits)
        for key in hits:
            self._found(key)

    def close(self, timeout: float = 5.0) -> None:
        with self._cv:
            self._closed = True
            self._keys.clear()
            self._due.clear()
            self._cv.notify_all()
        self._thread.join(timeout)
