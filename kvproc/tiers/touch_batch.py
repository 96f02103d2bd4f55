"""`TouchBatch`: pages a store used without asking its tier (verified loads), told to the tier in batches.

Why batched: a verified load's point is that no message to the tier is on the resolve's path. The tier still has to
see the use (its LRU would otherwise evict a hot prefix as if it were cold), but a `TouchPages` per resolve costs the
resolving thread ~60 us of encoding and sending right where it is about to return. Here the keys are appended under a
lock, the first key of a window arms one timer on the store's loop, and the loop sends everything gathered as one
message `delay_s` later (or at once past `max_keys`). A touch is a hint: losing one (the tier died) costs nothing but
recency.
"""

from __future__ import annotations

import threading
from typing import Sequence

from kvproc.runtime.loopthread import LoopThread
from kvproc.tiers.api import Tier


class TouchBatch:
    def __init__(self, loop: LoopThread, tier: Tier, *, delay_s: float = 0.02, max_keys: int = 4096) -> None:
        self._loop, self._tier = loop, tier
        self.delay_s, self.max_keys = delay_s, max_keys
        self._keys: list[bytes] = []
        self._lock = threading.Lock()
        self.sent = 0  # TouchPages messages sent (tests, stats)

    def add(self, keys: Sequence[bytes]) -> None:
        """Any thread. Queue `keys` for the tier's LRU; the first of a window arms the loop's timer."""
        with self._lock:
            first = not self._keys
            self._keys.extend(keys)
            full = len(self._keys) >= self.max_keys
        try:
            if full:
                self._loop.call(self.flush)
            elif first:
                self._loop.call(self._arm)
        except RuntimeError:  # the store's loop is closed (a resolve racing the store's close): a hint, dropped
            with self._lock:
                self._keys.clear()

    def _arm(self) -> None:  # on the loop
        self._loop.loop.call_later(self.delay_s, self.flush)

    def flush(self) -> None:
        """Send what is queued now (the loop's timer, or the store closing)."""
        with self._lock:
            keys, self._keys = self._keys, []
        if keys:
            self._tier.touch(list(dict.fromkeys(keys)))  # one message; a page used twice in the window once
            self.sent += 1
