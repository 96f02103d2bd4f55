"""`Counters`: a role's named integer counters, exposed through its `StatsReport` and read by the console."""

from __future__ import annotations

import threading


class Counters:
    """A dict of ints behind one lock: increments come from handler threads, reads from the stats handler."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values: dict[str, int] = {}

    def inc(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._values[name] = self._values.get(name, 0) + n

    def inc_many(self, pairs: tuple[tuple[str, int], ...]) -> None:
        """Several increments under one acquisition of the lock (a hot path's few counters)."""
        with self._lock:
            v = self._values
            for name, n in pairs:
                v[name] = v.get(name, 0) + n

    def set(self, name: str, value: int) -> None:
        with self._lock:
            self._values[name] = value

    def get(self, name: str) -> int:
        return self._values.get(name, 0)

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)
