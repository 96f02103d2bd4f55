"""Handles that own pool references: a prefix hold (probe result), a reservation (destination of a load), a pin
(source of a save).

Each handle keeps its references in a small state object; the handle itself only points at it. A garbage-collected
handle hands that state to the pool's deferred-release queue (never releases inline: `__del__` can run in the middle
of a pool operation on the same thread, where taking the lock again would deadlock or interleave). `__del__` rather
than `weakref.finalize`: a resolve makes two or three handles, and a finalizer's registration and `detach` cost ~5 us
per handle on the hot path, `__del__` nothing until it runs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

import numpy as np

if TYPE_CHECKING:
    from kvproc.core.paged import TokenIds
    from kvproc.core.pool import BlockPool


class HoldConsumedError(RuntimeError):
    """A prefix hold was used after `match_and_add_prefix` consumed it (or after release)."""


class ReusePolicy(enum.Enum):
    CAPPED = "capped"  # reuse at most (len-1)//page pages: one token must be computed to emit one
    FULL_PAGES = "full_pages"  # every full page (the decode side of a hand-off; trace-style hit counting)


class MissReason(enum.Enum):
    HIT = "hit"
    NO_ENTRY = "no_entry"  # not even the first page is indexed
    ENTRY_INCOMPLETE = "entry_incomplete"  # pages matched, but no complete checkpoint (a bounded artifact missing)
    BELOW_REUSE_CAP = "below_reuse_cap"  # a match existed, the reuse cap cut it to nothing
    PREFIX_CACHING_OFF = "prefix_caching_off"  # the model's spec turned prefix caching off
    POOL_PRESSURE = "pool_pressure"  # holding the match would have eaten into admitted requests' entitlement


@dataclass
class HoldState:
    ids: list[int]
    gens: np.ndarray
    hashes: list[bytes]
    # bounded group -> (staging slot, generation) of the checkpoint the hold restores to
    artifacts: dict[str, tuple[int, int]]
    released: bool = False


@dataclass
class ReservationState:
    ids: list[int]
    gens: np.ndarray
    staging: dict[str, tuple[int, int]]
    released: bool = False


@dataclass
class PinState:
    ids: list[int]
    staging: dict[str, int] = field(default_factory=dict)
    released: bool = False


S = TypeVar("S", HoldState, ReservationState, PinState)


class _Handle(Generic[S]):
    """Owns one state object's pool references until they are taken (moved elsewhere) or released."""

    _gone = "this handle was already consumed or released"

    def __init__(self, pool: "BlockPool", state: S) -> None:
        self._pool = pool
        self._state: S | None = state

    def __del__(self) -> None:
        state = self._state
        if state is not None:  # dropped while still owning references: the pool releases them at its next operation
            self._pool.defer_release(state)

    @property
    def pool(self) -> "BlockPool":
        """The pool (one rank of one store) this handle's references are in: the only pool that takes it back."""
        return self._pool

    def _live(self) -> S:
        if self._state is None:
            raise HoldConsumedError(self._gone)
        return self._state

    def _take(self) -> S:
        """Move the references out of the handle (for the pool and `RequestKv` only)."""
        state = self._live()
        self._state = None
        return state

    def release(self) -> None:
        """Give the references back. Idempotent; a consumed handle has nothing left to release."""
        if self._state is not None:
            self._pool._release_state(self._take())


class PrefixHold(_Handle[HoldState]):
    """The matched prefix of a probe: references on its blocks (and on the bounded checkpoint slots), no allocation.

    It survives eviction pressure until consumed by `RequestKv.match_and_add_prefix` or released. After either, any
    use raises `HoldConsumedError`: the references have moved or gone, so the hold cannot be used twice.
    """

    _gone = "this prefix hold was already consumed or released"

    def __init__(
        self,
        pool: "BlockPool",
        state: HoldState,
        *,
        reason: MissReason,
        matched_pages: int,
        page_tokens: int,
    ) -> None:
        super().__init__(pool, state)
        self.reason = reason
        self.matched_pages = matched_pages  # paged-index match before caps and checkpoint alignment
        self.page_tokens = page_tokens
        # The prompt probed for, as its hash packed it (the store's resolve sets it: `PageHashes.data`, a `TokenIds`):
        # pages restored into this hold take their token ids from it for KV events (`BlockPool.commit_loaded_blocks`).
        # A reference, never copied or read otherwise.
        self.prompt_tokens: TokenIds | None = None

    @property
    def num_blocks(self) -> int:
        return len(self._live().ids)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.page_tokens

    @property
    def block_ids(self) -> list[int]:
        return list(self._live().ids)

    @property
    def generations(self) -> np.ndarray:
        return self._live().gens.copy()

    @property
    def hashes(self) -> list[bytes]:
        return list(self._live().hashes)

    @property
    def artifacts(self) -> dict[str, tuple[int, int]]:
        return dict(self._live().artifacts)

    @property
    def consumed(self) -> bool:
        return self._state is None

    def __repr__(self) -> str:
        if self._state is None:
            return "PrefixHold(consumed)"
        return f"PrefixHold(blocks={self.num_blocks}, reason={self.reason.value})"


class Reservation(_Handle[ReservationState]):
    """Destination blocks (and staging slots) reserved for a load; the load's copy owns it until it settles.
    `release()` aborts it (the load failed or was not needed)."""

    _gone = "this reservation was already committed or released"

    @property
    def block_ids(self) -> list[int]:
        return list(self._live().ids)

    @property
    def generations(self) -> np.ndarray:
        return self._live().gens.copy()

    @property
    def staging(self) -> dict[str, tuple[int, int]]:
        return dict(self._live().staging)

    @property
    def settled(self) -> bool:
        return self._state is None


class Pin(_Handle[PinState]):
    """Blocks (and staging slots) pinned by an in-flight save: they cannot be evicted or reused until unpinned."""

    def __init__(self, pool: "BlockPool", state: PinState) -> None:
        super().__init__(pool, state)
        self.num_blocks = len(state.ids)

    @property
    def block_ids(self) -> list[int]:
        return [] if self._state is None else list(self._state.ids)


def align_holds(holds: "list[PrefixHold]") -> int:
    """Tensor parallel: one hold per rank (each from its own pool) for the same prompt may match prefixes of
    different lengths (a rank's cache evicted more). The ranks must restore the same prefix, so trim every hold to
    the shortest one's pages (each to a complete checkpoint at or below it, then all to the shortest of those),
    giving the rest back. Returns the common page count."""
    if not holds:
        return 0
    common = min(h.num_blocks for h in holds)
    while True:  # a bounded group's checkpoint may sit lower on one rank: trim again until every rank agrees
        kept = [h._pool.trim_hold(h, common) for h in holds]
        if all(k == kept[0] for k in kept):
            return kept[0]
        common = min(kept)
