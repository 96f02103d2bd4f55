"""The KV-event batch interval: its default, its bounds and the check every place that takes one runs (`kvproc up`,
`ClusterStore.start`, the host tier, `KvEventPublisher`). Here, in the runtime layer, so that `kvproc up` refuses a bad
value before any tier starts without importing the tiers.
"""

from __future__ import annotations

import math

DEFAULT_INTERVAL_S = 0.05
# The longest batch interval accepted: an hour already makes the events useless to a router; past it a typo (a
# value in microseconds, 1e10) would overflow the thread's timed wait (`threading.TIMEOUT_MAX`) and kill it.
MAX_INTERVAL_S = 3600.0


def check_interval(interval_s: float) -> float:
    """`interval_s` as a float, or ValueError saying what is accepted: (0, 1 h], finite."""
    try:
        v = float(interval_s)
    except (TypeError, ValueError):
        raise ValueError(f"KV-event batch interval must be a number of seconds, got {interval_s!r}") from None
    if not (math.isfinite(v) and 0 < v <= MAX_INTERVAL_S):
        raise ValueError(f"KV-event batch interval must be > 0 and <= {MAX_INTERVAL_S:g} s (1 h), got {interval_s!r}"
                         " s")
    return v


def interval_ms(interval_s: float) -> str:
    """The interval as the manifest's `published` records it (milliseconds, a string: `published` maps names to
    strings): "50", "3600000", "0.5"."""
    ms = round(interval_s * 1000, 3)
    return str(int(ms)) if ms == int(ms) else str(ms)
