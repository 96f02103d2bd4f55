"""Eviction policies for the device pool and the host tier: one protocol (`protocol.py`), chosen by name.

- ``lru``: `kvproc.core.lru.RunLru` (least recently released first, a request's tail before its head).
- ``lfu``: `FrequencyRecency` without decay, counts kept by content key (every use ever; ties by recency).
- ``lrfu``: `FrequencyRecency` with a decayed count (half-life, seconds of the owner's clock) kept by content key in a
  count-min sketch, so it outlives evictions. Measured against Belady on the Mooncake trace and a synthetic one:
  bench/RESULTS.md, "Trace replay".
"""

from __future__ import annotations

import math
import time
from typing import Callable

from kvproc.core.eviction.frequency import FrequencyRecency
from kvproc.core.eviction.protocol import EvictionPolicy
from kvproc.core.lru import RunLru

POLICIES = ("lru", "lfu", "lrfu")
DEFAULT_HALF_LIFE_S = 300.0
# Each owner's policy unless configured (`StoreConfig.eviction`, `kvproc up --eviction`). The host tier is where a
# conversation waits between turns: on the Mooncake conversation trace lrfu keeps 2.1x / 1.3x / 1.05x LRU's hit ratio
# at 1e6 / 3e6 / 1e7 tokens (with a retention hint too), so it is the tier's default. The device pool keeps LRU: its
# replay must stay cheap (lrfu's sketch and runs cost ~30% of the replay's requests per CPU second) and a hint never
# reaches it (bench/RESULTS.md, "Trace replay").
DEVICE_DEFAULT = "lru"
HOST_DEFAULT = "lrfu"


def make_policy(name: str, capacity: int, *, half_life: float = DEFAULT_HALF_LIFE_S,
                clock: Callable[[], float] = time.monotonic) -> EvictionPolicy:
    """The policy `name` over ids 0..capacity-1. `half_life` only matters to ``lrfu``; `clock` to ``lrfu`` and to a
    retention hint (`insert(..., retain_s=...)`) under ``lru``."""
    if name == "lru":
        return RunLru(capacity, clock=clock)
    if name == "lfu":
        return FrequencyRecency(capacity, half_life=math.inf, history=True, clock=clock)
    if name == "lrfu":
        return FrequencyRecency(capacity, half_life=half_life, history=True, clock=clock)
    raise ValueError(f"unknown eviction policy {name!r} (known: {', '.join(POLICIES)})")


__all__ = ["POLICIES", "DEFAULT_HALF_LIFE_S", "DEVICE_DEFAULT", "HOST_DEFAULT", "EvictionPolicy", "FrequencyRecency",
           "RunLru", "make_policy"]
