"""`HandoffPins`: which Mooncake keys each producer's hand-off created (and soft-pinned there), until it is revoked or
its pin lapses.

A hand-off's write-through soft-pins the keys it creates in Mooncake for the hand-off TTL (`MooncakeTier`): a decode
node anywhere may still need them. The producer's revoke ("nobody will read this") removes them; a consumer on another
node cannot tell this node, so a consumed hand-off's pins lapse in Mooncake on their own at the TTL (the pages stay
there as cache, evictable again) and are forgotten here at the same time, counted (`handoff_pins_lapsed`).

Only keys the hand-off *created* are recorded: a page Mooncake already held was another save's (a shared prefix) and
stays. A revoke that comes before the write-through has finished is remembered (until the TTL) so that the keys the
write then creates are removed at once. Bounded: at most `max_producers` producers are remembered (the oldest is
forgotten first, counted); nothing here does I/O.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any


class HandoffPins:
    def __init__(self, ttl_s: float, counters: Counter[str], *, max_producers: int = 4096,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl_s = ttl_s
        self.counters = counters
        self.max_producers = max_producers
        self.clock = clock
        self._pins: dict[str, tuple[list[str], float]] = {}  # producer -> (keys, expiry); insertion = expiry order
        self._revoked: dict[str, float] = {}  # producer -> expiry: revoked before (all of) its write-through ended

    def record(self, producer: str, keys: list[str]) -> list[str]:
        """The write-through created `keys` (soft-pinned). Returns the keys to remove now (the producer was revoked
        meanwhile), else []."""
        self.expire()
        if not keys:
            return []
        if producer in self._revoked:
            self.counters["handoff_revoked_before_written"] += 1
            return keys
        old = self._pins.pop(producer, ([], 0.0))[0]
        self._pins[producer] = (old + keys, self.clock() + self.ttl_s)
        self.counters["handoff_keys_pinned"] += len(keys)
        self._bound(self._pins, "handoff_pins_forgotten_full")
        return []

    def revoke(self, producer: str) -> list[str]:
        """The producer's revoke: its recorded keys (to remove), and remember it for a write still to come."""
        self.expire()
        self._revoked.pop(producer, None)
        self._revoked[producer] = self.clock() + self.ttl_s
        self._bound(self._revoked, "handoff_revokes_forgotten_full")
        got = self._pins.pop(producer, None)
        return got[0] if got is not None else []

    def expire(self) -> None:
        now = self.clock()
        while self._pins:
            producer, (_, exp) = next(iter(self._pins.items()))
            if exp > now:
                break
            del self._pins[producer]
            self.counters["handoff_pins_lapsed"] += 1  # consumed elsewhere (or forgotten): Mooncake's pin lapses too
        while self._revoked and next(iter(self._revoked.values())) <= now:
            del self._revoked[next(iter(self._revoked))]

    def _bound(self, d: dict[str, Any], counter: str) -> None:
        while len(d) > self.max_producers:
            del d[next(iter(d))]
            self.counters[counter] += 1

    @property
    def producers(self) -> int:
        return len(self._pins)
