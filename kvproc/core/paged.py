"""Paged block book-keeping for one rank: free -> active (referenced) -> inactive (sealed, unreferenced, matchable).

Not thread-safe by itself: `BlockPool` calls it under its one lock. Every block id carries a generation that changes
each time the block is handed out again, so a handle that crossed a boundary can be checked before its bytes are
trusted (a stale id would otherwise read someone else's KV).

Hot-path rule: refcounts and generations are numpy arrays. Where `kvproc.native._native` is built each operation is one C
pass over them (and over the prefix index, then a C table: `PrefixIndex`); without it, one fancy-index numpy call per step, the only per-block
Python work being the prefix index's dict traffic. Both forms check every id before changing anything, and give the
same results (tests run both). The C form matters because a resolve moves a few dozen ids at a time, where numpy's
fixed cost per call (a 64-id list takes ~4 us just to become an array) is most of the work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from itertools import takewhile
from operator import is_not
from typing import Protocol

import numpy as np

from kvproc.core.block_keys import BlockKeys
from kvproc.core.eviction import make_policy
from kvproc.native import NATIVE

_NOT_NONE = partial(is_not, None)
# A registration's token ids (`IndexListener.stored`): a sequence of ints, an int array, or bytes -- a prompt's ids
# packed as little-endian uint32 (`PageHashes.data`, what a restore registers), never one id per byte
TokenIds = Sequence[int] | np.ndarray | bytes


class PrefixIndexLike(Protocol):
    """What the pool and its readers use of the prefix index: a mapping page hash -> block id (a dict, or the native
    `PrefixIndex`, which also has `match`)."""

    def __len__(self) -> int: ...
    def __getitem__(self, key: bytes) -> int: ...
    def __contains__(self, key: object) -> bool: ...
    def __iter__(self) -> Iterator[bytes]: ...
    def __setitem__(self, key: bytes, value: int) -> None: ...
    def __delitem__(self, key: bytes) -> None: ...
    def get(self, key: bytes, default: int | None = None) -> int | None: ...
    def update(self, pairs: Iterable[tuple[bytes, int]]) -> None: ...


class PoolExhaustedError(RuntimeError):
    """An allocation asked for more blocks than free + evictable; nothing was taken (all-or-nothing)."""


class StaleBlockError(RuntimeError):
    """A block handle's generation no longer matches: the block was reused since the handle was made."""


class IndexListener(Protocol):
    """Told of every change to the prefix index's key set (KV events: `kvproc/tiers/device_index_events.py`
    `DeviceIndexEvents`), under the pool's lock, so in the order the changes happened."""

    def stored(self, hashes: Sequence[bytes], positions: list[int], tokens: TokenIds | None = None,
               first_page: int = 0, parent: bytes | None = None) -> None:
        """`hashes[i]` for each i in `positions` (ascending) became a key of the index, in one `register` call;
        `tokens`, when the caller knew them, holds the token ids of the registered pages, page i's at
        `tokens[(first_page + i) * page_tokens:(first_page + i + 1) * page_tokens]`, which the caller never changes
        afterwards (a request's sealed pages' tokens never change; a restore passes the prompt its engine resolved,
        which the engine does not change: `KvStore.resolve_prefix`), so a listener may keep it uncopied and
        unsliced. `parent`: the chain's page before `hashes[0]` (None: `hashes[0]` is its first page)."""

    def removed(self, hashes: list[bytes]) -> None:
        """These keys left the index (their block was evicted while it owned the entry)."""


class PagedBlocks:
    def __init__(self, num_blocks: int, eviction: str = "lru") -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.refcount = np.zeros(num_blocks, dtype=np.int32)
        self.generation = np.zeros(num_blocks, dtype=np.int64)
        self.hashed = np.zeros(num_blocks, dtype=bool)
        # The hash each block is registered under: 16 bytes a block in one array, no object per indexed page
        # (`BlockKeys`; reads as the list of bytes / None it was).
        self.block_hash = BlockKeys(self.hashed)
        # Stack: popping from the end hands out low ids first, which keeps early runs contiguous for the copy path.
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))
        # Sealed, unreferenced blocks, ordered by the eviction policy (`kvproc.core.eviction`; LRU by default).
        self.inactive = make_policy(eviction, num_blocks)
        # page hash -> block id. Where the native module is built, a C open-addressing table (`PrefixIndex`,
        # kvproc/native/_prefix_index.c: no Python object per entry, whole chains per call) that reads as a mapping;
        # else a dict. The C paged ops take only the table, the Python forms below only need the mapping.
        self.index: PrefixIndexLike = NATIVE.PrefixIndex() if NATIVE is not None else {}
        self.evictions = 0
        # KV events: None (the default) costs one attribute test per register / unhash call, nothing per block.
        self.listener: IndexListener | None = None
        if NATIVE is not None:
            # One item per block, only ints, so never part of a cycle: out of the GC's scans, which would otherwise
            # walk every block's item at each full collection.
            NATIVE.untrack_atomic(self.free)

    # -- capacity -------------------------------------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Blocks an allocation can obtain now: free plus evictable."""
        return len(self.free) + len(self.inactive)

    # -- allocation -----------------------------------------------------------------------------------------------
    def allocate(self, n: int) -> list[int]:
        """Take `n` blocks (refcount 1 each), evicting LRU inactive blocks if needed; all-or-nothing."""
        return self.allocate_with_generations(n)[0]

    def allocate_with_generations(self, n: int) -> tuple[list[int], np.ndarray]:
        """`allocate`, and the blocks' new generations (a handle's), in the same pass."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.available:
            raise PoolExhaustedError(f"asked for {n} blocks, only {self.available} free or evictable")
        take = min(n, len(self.free))
        ids = self.free[len(self.free) - take :]
        del self.free[len(self.free) - take :]
        ids.reverse()
        if n > take:
            evicted = self.inactive.pop_oldest(n - take)
            self._unhash(evicted)
            ids.extend(evicted)
        self.evictions += n - take
        if not ids:
            return ids, np.empty(0, dtype=np.int64)
        if NATIVE is not None:
            return ids, np.frombuffer(NATIVE.paged_take(self.refcount, self.generation, ids), dtype=np.int64)
        idx = np.asarray(ids, dtype=np.int64)
        self.refcount[idx] = 1
        self.generation[idx] += 1
        return ids, self.generation[idx]  # fancy indexing copies

    def evict_all(self) -> int:
        """Forget every sealed, unreferenced block (the LRU) and free it: the prefix index keeps only pages some
        holder still references. Returns how many were evicted."""
        n = len(self.inactive)
        if n:
            evicted = self.inactive.pop_oldest(n)
            self._unhash(evicted)
            self.free.extend(reversed(evicted))
            self.evictions += n
        return n

    def _unhash(self, ids: list[int]) -> None:
        listener = self.listener
        removed: list[bytes] | None = None if listener is None else []
        if NATIVE is not None:
            NATIVE.paged_unhash(self.hashed, self.block_hash.array, self.index, ids, removed)
        else:
            index, block_hash = self.index, self.block_hash  # a displaced duplicate no longer owns its index entry
            for bid in ids:
                h = block_hash[bid]
                if h is not None and index.get(h) == bid:
                    del index[h]
                    if removed is not None:
                        removed.append(h)
            self.hashed[ids] = False  # a block's key is dropped with its flag (`BlockKeys`)
        if removed:
            listener.removed(removed)  # type: ignore[union-attr]  # removed is a list only with a listener

    def acquire(self, ids: Sequence[int]) -> None:
        """Add one reference to each block (blocks must be active or inactive, never free)."""
        if not len(ids):
            return
        if NATIVE is not None:
            left_lru, free = NATIVE.paged_acquire(self.refcount, self.hashed, self.inactive.stamp, ids)
            if free:
                raise RuntimeError(f"acquire of free blocks {free}")
            self.inactive.removed(left_lru)
            return
        idx = np.asarray(ids, dtype=np.int64)
        rc = self.refcount[idx]
        cold = idx[rc == 0]
        if cold.size:
            if not self.hashed[cold].all():
                raise RuntimeError(f"acquire of free blocks {cold[~self.hashed[cold]].tolist()[:8]}")
            self.inactive.remove(cold)  # a referenced block leaves the LRU
        # Plain fancy-index add: the ids of one hold / request / pin are distinct by construction.
        self.refcount[idx] += 1

    def release(self, ids: Sequence[int]) -> int:
        """Drop one reference from each block; returns how many became unreferenced.

        Blocks are released tail-first so that, within one request, the tail of a chain is evicted before its head
        (a head shared by many prompts is worth more than a tail).
        """
        if not len(ids):
            return 0
        if NATIVE is not None:
            # The blocks going to the eviction policy come packed (int64), kept as its run: no int object per id
            # made here, nor kept alive per cached block.
            packed, free_zero, underflow = NATIVE.paged_release(self.refcount, self.hashed, ids, True)
            if underflow is not None:
                raise RuntimeError(f"refcount underflow releasing blocks {underflow}")
            if packed:
                self.inactive.insert(np.frombuffer(packed, dtype=np.int64))
            self.free.extend(free_zero)
            return len(packed) // 8 + len(free_zero)
        idx = np.asarray(ids, dtype=np.int64)[::-1]
        rc = self.refcount[idx] - 1
        if (rc < 0).any():
            raise RuntimeError(f"refcount underflow releasing blocks {idx[rc < 0].tolist()}")
        self.refcount[idx] = rc  # ids of one holder are distinct, so a plain fancy-index store is exact
        zero = idx[rc == 0]
        if zero.size:
            hashed = self.hashed[zero]
            self.inactive.insert(zero[hashed])
            self.free.extend(zero[~hashed].tolist())
        return int(zero.size)

    # -- the prefix index -----------------------------------------------------------------------------------------
    def register(self, ids: Sequence[int] | np.ndarray, hashes: Sequence[bytes], tokens: TokenIds | None = None,
                 first_page: int = 0, parent: bytes | None = None) -> None:
        """Make sealed blocks matchable under their page hashes. `tokens` (token ids holding the pages', from page
        `first_page` of `tokens` on) and `parent` (the chain's page before `hashes[0]`), both optional, only go to
        the listener (KV events' `token_ids` and `parent_block_hash`).

        If a hash is already indexed (the same prefix was computed twice, or restored while computed) the newest
        block takes the index entry: both hold identical KV, and the displaced block keeps its hash but is no longer
        reachable, so it simply ages out of the LRU. This keeps registration one C call over the chain.
        """
        listener = self.listener
        if self.inactive.wants_keys:  # a policy keeping history by content (lrfu): the pages' keys, one numpy pass
            self.inactive.bind(ids, hashes)
        if NATIVE is not None:
            if listener is None:
                NATIVE.paged_register(self.hashed, self.block_hash.array, self.index, ids, hashes)
                return
            added: list[int] = []
            NATIVE.paged_register(self.hashed, self.block_hash.array, self.index, ids, hashes, added)
            if added:
                listener.stored(hashes, added, tokens, first_page, parent)
            return
        idx = np.asarray(ids, dtype=np.int64)
        all_hashes = hashes
        hashes = list(hashes)
        already = self.hashed[idx]
        if already.any():
            keep = ~already
            idx = idx[keep]
            hashes = [h for h, k in zip(hashes, keep.tolist()) if k]
        if not idx.size:
            return
        ids_list = idx.tolist()
        new: list[int] = []
        if listener is not None:  # the keys the index does not hold yet (a hash twice in the call: its first)
            index, fresh = self.index, set()
            for p, h in zip(np.flatnonzero(~already).tolist(), hashes):
                if h not in index and h not in fresh:
                    fresh.add(h)
                    new.append(p)
        for h in hashes:  # the C form's check: the key array holds 16-byte page hashes
            if type(h) is not bytes or len(h) != 16:
                raise ValueError(f"page hashes are 16 bytes, got {h!r:.40}")
        self.index.update(zip(hashes, ids_list))
        self.block_hash.array[idx] = np.frombuffer(b"".join(hashes), dtype=np.uint8).reshape(-1, 16)
        self.hashed[idx] = True
        if new:
            # new is non-empty only with a listener
            listener.stored(all_hashes, new, tokens, first_page, parent)  # type: ignore[union-attr]

    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """Block ids of the longest indexed prefix of `hashes` (one C call over the chain where the table is built,
        else one dict probe per page, in C)."""
        if NATIVE is not None:
            return self.index.match(hashes)  # type: ignore[attr-defined]  # the C table (__init__)
        get: Callable[[bytes], int | None] = self.index.get
        return list(takewhile(_NOT_NONE, map(get, hashes)))  # type: ignore[arg-type]

    # -- generations ----------------------------------------------------------------------------------------------
    def generations(self, ids: Sequence[int]) -> np.ndarray:
        if not len(ids):
            return np.empty(0, dtype=np.int64)  # a miss's hold: skip the fancy-index round trip
        if NATIVE is not None:
            return np.frombuffer(NATIVE.paged_gens(self.generation, ids), dtype=np.int64)  # a writable copy
        return self.generation[np.asarray(ids, dtype=np.int64)]  # fancy indexing already returns a copy

    def check(self, ids: Sequence[int] | np.ndarray, gens: np.ndarray) -> None:
        if NATIVE is not None:
            stale = NATIVE.paged_check(self.generation, ids, np.ascontiguousarray(gens, dtype=np.int64))
            if stale:
                raise StaleBlockError(f"stale block handles (reused since issued): {stale}")
            return
        idx = np.asarray(ids, dtype=np.int64)
        bad = self.generation[idx] != np.asarray(gens)
        if bad.any():
            raise StaleBlockError(f"stale block handles (reused since issued): {idx[bad].tolist()[:8]}")

    # -- invariants (tests) ---------------------------------------------------------------------------------------
    def state_of(self) -> dict[str, set[int]]:
        active = set(np.nonzero(self.refcount > 0)[0].tolist())
        return {"free": set(self.free), "inactive": set(self.inactive), "active": active}

