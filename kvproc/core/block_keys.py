"""`BlockKeys`: the page hash each block of a device pool is registered under, 16 bytes a block in one array.

Until issue 35 this was a list holding one 16-byte `bytes` object per indexed block. In an unbounded pool (the
trace replay: millions of indexed pages) those objects were never freed, so every indexed page cost a pymalloc
allocation, and pymalloc's arenas grew by page faults (22% of the replay's faults). Here a block's key is its 16
bytes in a zero-initialised array (pages are faulted in once, 256 blocks each), valid while `hashed[block]` is set;
the C paged ops (`paged_register` / `paged_unhash`) copy keys in and read them back without an object.

It still reads as the list did (`keys[bid]` -> bytes or None, iteration, equality with a list): the store's save
check and the tests' invariants use it that way. Not thread-safe by itself (the pool's lock covers it).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import overload

import numpy as np

KEY_BYTES = 16  # every page hash kvproc makes (`kvproc.core.hashing.HASH_BYTES`)


class BlockKeys(Sequence["bytes | None"]):
    __slots__ = ("array", "hashed")

    def __init__(self, hashed: np.ndarray) -> None:
        # `hashed` is the pool's own flag array (shared, not copied): a block's key means something only while set.
        self.hashed = hashed
        self.array = np.zeros((hashed.size, KEY_BYTES), dtype=np.uint8)

    def __len__(self) -> int:
        return int(self.hashed.size)

    @overload
    def __getitem__(self, bid: int) -> bytes | None: ...
    @overload
    def __getitem__(self, bid: slice) -> list[bytes | None]: ...

    def __getitem__(self, bid: int | slice) -> bytes | None | list[bytes | None]:
        if isinstance(bid, slice):
            return [self[i] for i in range(*bid.indices(len(self)))]
        return self.array[bid].tobytes() if self.hashed[bid] else None

    def __setitem__(self, bid: int, key: bytes | None) -> None:
        """Set one block's key (None: unhashed). The pool's Python form, and tests that simulate a takeover."""
        if key is None:
            self.hashed[bid] = False
            return
        if len(key) != KEY_BYTES:
            raise ValueError(f"block keys are {KEY_BYTES}-byte page hashes, got {len(key)} bytes")
        self.array[bid] = np.frombuffer(key, dtype=np.uint8)
        self.hashed[bid] = True

    def __iter__(self) -> Iterator[bytes | None]:
        for bid in range(len(self)):
            yield self[bid]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockKeys):
            other = list(other)
        return isinstance(other, list) and list(self) == other

    __hash__ = None  # type: ignore[assignment]  # mutable, compares by content

    def of(self, ids: Sequence[int]) -> list[bytes | None]:
        """Each block's key (None where unhashed), in one vectorised gather: the store's save check."""
        if not len(ids):
            return []
        idx = np.asarray(ids, dtype=np.int64)
        raw = self.array[idx].tobytes()
        flags = self.hashed[idx].tolist()
        return [raw[KEY_BYTES * i:KEY_BYTES * (i + 1)] if f else None for i, f in enumerate(flags)]
