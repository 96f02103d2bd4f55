"""Value types of the store's verbs: configuration, policies, the resolve result, the seal cursor, outcomes."""

from __future__ import annotations

import collections
import itertools
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Deque, NamedTuple

from kvproc.core.eviction import POLICIES
from kvproc.core.hashing import PageHashes
from kvproc.core.holds import PrefixHold, ReusePolicy
from kvproc.tiers.host_index import SaveClass

__all__ = ["InvalidSealCursor", "KvPrefix", "Outcomes", "ResolvePolicy", "SaveClass", "SealCursor", "StoreConfig"]


# The engine's step fence (`KvStore(step_fence=)`, `ClusterStore.attach_model(step_fence=)`): rank -> the CUDA IPC
# handle of the event the engine recorded after its latest step on that rank's device (None: nothing to wait for).
StepFence = Callable[[int], bytes | None]


def check_retain_s(retain_s: float | None, save_class: SaveClass) -> float | None:
    """A seal's retention hint (`KvStore.seal(retain_s=...)`), checked where the engine calls: None (no hint) or a
    finite duration >= 0 in seconds (0 is no hint either), on a cacheable save (a hand-off is pinned for its consumer
    anyway, and the hint would be lost when the pin goes)."""
    if retain_s is None:
        return None
    if isinstance(retain_s, bool) or not isinstance(retain_s, (int, float)):
        raise TypeError(f"retain_s must be a number of seconds or None, got {type(retain_s).__name__}")
    if not (math.isfinite(retain_s) and retain_s >= 0):
        raise ValueError(f"retain_s must be a finite duration >= 0 (seconds), got {retain_s!r}")
    if save_class is not SaveClass.CACHEABLE:
        raise ValueError("retain_s is a hint for cacheable saves; a hand-off is pinned until its consumer loads it")
    return float(retain_s) or None


@dataclass(frozen=True)
class StoreConfig:
    # One deadline for a whole resolve: a safety net, not a latency target (reference design section 4).
    resolve_deadline_s: float = 15.0
    # Cacheable saves may pin at most this fraction of a rank's pool; beyond it they are shed (Handoff saves are
    # not counted against it: they only back-pressure admission). Benchmark: `kvproc demo --runs kvproc
    # --pin-fraction F` (bench/RESULTS.md, "Pin budget"): at 0.05, 0.25 and 1.0 no save was ever shed and TTFT was
    # unchanged, so the bound only matters for a slow tier; the reference system's 25% is kept as that safety margin.
    cacheable_pin_fraction: float = 0.25
    # Miss-breaker: after this many consecutive cold misses for a scope, skip the tier for `breaker_cooldown_s`.
    breaker_misses: int = 64
    breaker_cooldown_s: float = 2.0
    tier_call_timeout_s: float = 5.0
    outcome_history: int = 4096
    # The eviction policy (`kvproc.core.eviction`: lru, lfu, lrfu) of this store's device pools and of the host tiers
    # it configures: sent with its `Configure`, so a tier the store's own cluster started (`ClusterStore.start`) and
    # an in-process one (`build_local_store`) evict by it. A shared `kvproc up` tier keeps its own (`--eviction`; the
    # store reads it back as `ClusterStore.tier_evictions`). None: each layer's default, LRU for the device pools and
    # lrfu for the host tiers (`kvproc.core.eviction.DEVICE_DEFAULT` / `HOST_DEFAULT`, and why there).
    eviction: str | None = None

    def __post_init__(self) -> None:
        if self.eviction is not None and self.eviction not in POLICIES:  # here: a typo must not start a store
            raise ValueError(f"StoreConfig.eviction must be one of {', '.join(POLICIES)}, got {self.eviction!r}")


@dataclass(frozen=True)
class ResolvePolicy:
    reuse: ReusePolicy = ReusePolicy.CAPPED
    # Wait through misses until the producer's save lands (decode side of a P/D hand-off).
    wait_for_full_hit: bool = False
    deadline_s: float | None = None  # None: StoreConfig.resolve_deadline_s
    # The consumer's load completing releases this producer's Handoff lease (P/D decode side).
    consume_handoff_of: str | None = None

    def __post_init__(self) -> None:
        d = self.deadline_s
        # 0 must not quietly mean "the default" (and a NaN deadline would never pass): None is the only default.
        if d is not None and (isinstance(d, bool) or not isinstance(d, (int, float)) or not math.isfinite(d)
                              or d <= 0):
            raise ValueError(f"ResolvePolicy.deadline_s must be a positive finite number of seconds or None (the "
                             f"store's resolve_deadline_s), got {d!r}")


FULL_HIT = ResolvePolicy(reuse=ReusePolicy.FULL_PAGES, wait_for_full_hit=True)


@dataclass
class KvPrefix:
    """The one result of a resolve: the held prefix. Degradation shows only as fewer tokens (and in stats)."""

    hold: PrefixHold
    device_tokens: int = 0  # served from the device pool
    host_tokens: int = 0  # restored from the host tier
    # The chained hashes of every full page of the prompt, as this resolve computed them (its scope): hand them to
    # `RequestKv(..., prompt_hashes=...)` for the same prompt and scope, which checks them against its tokens (one
    # byte comparison) and then does not hash it again. None when the resolve hashed nothing (it was cancelled
    # before it started).
    page_hashes: PageHashes | None = None

    @property
    def hit_tokens(self) -> int:
        return self.device_tokens + self.host_tokens


class HandoffUnavailable(RuntimeError):
    """A `SaveClass.HANDOFF` seal or retire this store cannot deliver: prefix caching is off for the model (`reason`
    is `spec.prefix_caching_off_reason`) or the rank has no host tier. Refused, never accepted with nothing saved (a
    "KV ready" barrier would otherwise fire with nothing in the tier)."""

    def __init__(self, req_id: str, reason: str) -> None:
        super().__init__(f"request {req_id!r}: a hand-off cannot be saved: {reason}")
        self.req_id, self.reason = req_id, reason


class InvalidSealCursor(ValueError):
    """A `SealCursor` that is not a page count of the request being sealed (negative, not an int, past its lifetime)."""


@dataclass
class SealCursor:
    """How far a request's pages have been handed to the tier (pages). Starts after the prefix hit: pages that
    came from the cache are not re-saved. A shed save moves it back so a later seal retries."""

    pages: int = 0
    pending: int = 0  # saves in flight for this request
    settled: threading.Event = field(default_factory=threading.Event)
    # The request it counts for (`RequestKv.identity`), bound by the first seal or retire that uses it: a later use
    # with another request is refused (`ForeignHandleError`).
    owner: object | None = field(default=None, repr=False, compare=False)

    @classmethod
    def after_prefix(cls, prefix_pages: int) -> "SealCursor":
        c = cls(prefix_pages)
        c.settled.set()
        return c


class Outcome(NamedTuple):
    """Immutable, and a NamedTuple rather than a frozen dataclass: two are made per resolve, and a frozen
    dataclass's `__init__` (one `object.__setattr__` per field) costs ~10x more."""

    op: str  # resolve | save | load | retire
    req_id: str
    state: str  # ok | degraded | failed | shed
    reason: str
    at: float


class Outcomes:
    """Every async operation's terminal state, with its request id: counted, and the recent ones kept."""

    def __init__(self, keep: int) -> None:
        self.recent: Deque[Outcome] = collections.deque(maxlen=keep)
        self.counts: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()

    def record(self, op: str, req_id: str, state: str, reason: str = "") -> Outcome:
        o = Outcome(op, req_id, state, reason, time.time())
        key = f"{op}.{state}.{reason}" if reason else f"{op}.{state}"
        with self._lock:
            self.recent.append(o)
            self.counts[key] += 1
        return o

    def for_request(self, req_id: str, op: str | None = None, last: int | None = None) -> list[Outcome]:
        """The recent outcomes of one request (of one kind of operation, if `op`), oldest first. A load a resolve
        stopped waiting for, or did not use, settles after the resolve: its outcome may come after the resolve's.
        `last`: search only the newest `last` outcomes (a caller that has just finished the request: the whole
        history is thousands of entries, a scan that costs more than a resolve)."""
        with self._lock:
            recent = self.recent if last is None else itertools.islice(reversed(self.recent), last)
            found = [o for o in recent if o.req_id == req_id and (op is None or o.op == op)]
        return found if last is None else found[::-1]
