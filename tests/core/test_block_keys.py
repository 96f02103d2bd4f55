"""The pool's per-block key array (`BlockKeys`, issue 35): it reads as the list of bytes / None it replaced, in both
the C and the Python forms of the paged ops, and the C ops keep no object per indexed block."""

from __future__ import annotations

import numpy as np
import pytest

import kvproc.core.paged as paged_mod
from kvproc.core.block_keys import BlockKeys
from kvproc.core.paged import PagedBlocks

KEYS = [i.to_bytes(16, "little") for i in range(1, 9)]


def test_block_keys_round_trip_and_read_as_a_list() -> None:
    hashed = np.zeros(6, dtype=bool)
    keys = BlockKeys(hashed)
    assert list(keys) == [None] * 6 and keys == [None] * 6 and len(keys) == 6
    keys[2] = KEYS[0]
    keys[4] = KEYS[1]
    assert keys[2] == KEYS[0] and keys[4] == KEYS[1] and keys[3] is None
    assert hashed.tolist() == [False, False, True, False, True, False]  # the flag is the pool's own array
    assert keys[1:5] == [None, KEYS[0], None, KEYS[1]]
    assert keys.of([4, 3, 2]) == [KEYS[1], None, KEYS[0]] and keys.of([]) == []
    keys[2] = None
    assert keys[2] is None and not hashed[2]
    assert keys == [None, None, None, None, KEYS[1], None] and keys != [None] * 6
    with pytest.raises(ValueError, match="16-byte"):
        keys[0] = b"short"


@pytest.mark.parametrize("native", [True, False])
def test_register_evict_and_reregister_keep_each_blocks_key(native: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keys written by register are read back per block; an evicted block reads None and a reused one its new key
    (the C form copies keys into the array, the Python form stores them there too)."""
    if not native:
        monkeypatch.setattr(paged_mod, "NATIVE", None)
    elif paged_mod.NATIVE is None:
        pytest.skip("kvproc.native._native not built")
    pb = PagedBlocks(4)
    ids = pb.allocate(4)
    pb.register(ids, KEYS[:4])
    assert [pb.block_hash[b] for b in ids] == KEYS[:4] and pb.block_hash.of(ids) == KEYS[:4]
    pb.release(ids)  # all four sealed and unreferenced: evictable, tail first
    again = pb.allocate(2)  # evicts two of them: their keys go
    assert sorted(again) == sorted(ids[2:]) and pb.block_hash.of(again) == [None, None]
    pb.register(again, KEYS[4:6])
    assert pb.block_hash.of(again) == KEYS[4:6] and pb.block_hash.of(ids[:2]) == KEYS[:2]
    assert dict(pb.index) == {KEYS[0]: ids[0], KEYS[1]: ids[1], KEYS[4]: again[0], KEYS[5]: again[1]}


def test_the_c_ops_keep_no_key_object_per_block() -> None:
    """The array holds copies: the caller's hash objects are not referenced once register returns."""
    import sys

    if paged_mod.NATIVE is None:
        pytest.skip("kvproc.native._native not built")
    pb = PagedBlocks(4)
    ids = pb.allocate(2)
    hashes = [bytes([7]) * 15 + bytes([i]) for i in range(2)]  # made here: only this list refers to them
    before = [sys.getrefcount(h) for h in hashes]
    pb.register(ids, hashes)
    assert [sys.getrefcount(h) for h in hashes] == before
    assert pb.block_hash.of(ids) == hashes
