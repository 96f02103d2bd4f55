"""`PrefixIndex` (kvproc/native/_prefix_index.c), the device pool's prefix index, behaves as the dict it replaced:
the same answers under any sequence of inserts, deletes, lookups and chain matches, through growth and through the
backward shifts of its deletes."""

from __future__ import annotations

from itertools import takewhile

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproc import native

N = native._native
pytestmark = pytest.mark.skipif(N is None, reason="kvproc.native._native not built")

# Few distinct keys, so operations hit the same keys again; half random bytes, half counters (tests' usual keys:
# low-entropy, the table must mix them), and sometimes many keys at once so the table grows past its first size.
KEYS = [bytes([i]) * 16 for i in range(40)] + [i.to_bytes(16, "little") for i in range(40)] + \
    [bytes((i * 37 + j * 11) % 256 for j in range(16)) for i in range(80)]
key = st.sampled_from(KEYS)
op = st.one_of(
    st.tuples(st.just("set"), key, st.integers(0, 2**40)),
    st.tuples(st.just("del"), key, st.none()),
    st.tuples(st.just("get"), key, st.none()),
    st.tuples(st.just("match"), st.lists(key, max_size=12), st.none()),
    st.tuples(st.just("bulk"), st.lists(key, min_size=20, max_size=120), st.integers(0, 1000)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=120))
def test_prefix_index_agrees_with_a_dict(ops: list[tuple]) -> None:
    table, ref = N.PrefixIndex(), {}
    for kind, a, b in ops:
        if kind == "set":
            table[a] = b
            ref[a] = b
        elif kind == "bulk":
            for i, k in enumerate(a):
                table[k] = b + i
                ref[k] = b + i
        elif kind == "del":
            if a in ref:
                del table[a]
                del ref[a]
            else:
                with pytest.raises(KeyError):
                    del table[a]
        elif kind == "get":
            assert table.get(a) == ref.get(a) and table.get(a, -5) == ref.get(a, -5) and (a in table) == (a in ref)
            if a in ref:
                assert table[a] == ref[a]
            else:
                with pytest.raises(KeyError):
                    table[a]
        else:
            assert table.match(a) == list(takewhile(lambda v: v is not None, map(ref.get, a)))
        assert len(table) == len(ref)
    # every key still reachable after the shifts of the deletes: the whole content, both ways
    assert table == ref and dict(table.items()) == ref and sorted(table) == sorted(ref)
    assert sorted(table.values()) == sorted(ref.values()) and all(table[k] == v for k, v in ref.items())


def test_prefix_index_treats_what_cannot_be_a_key_as_absent_and_refuses_to_store_it() -> None:
    table = N.PrefixIndex()
    table[b"a" * 16] = 3
    assert table.get(b"a" * 15) is None and b"a" * 17 not in table and "a" * 16 not in table
    assert table.match([b"a" * 16, "x", b"a" * 16]) == [3]
    with pytest.raises(ValueError, match="16-byte"):
        table[b"short"] = 1
    with pytest.raises(TypeError, match="not bytes"):
        table["a" * 16] = 1
    with pytest.raises(ValueError, match="non-negative"):
        table[b"b" * 16] = -1
    assert table == {b"a" * 16: 3} and table != {b"a" * 16: 4}


def test_paged_register_and_unhash_keep_the_table_and_a_pure_python_pool_alike() -> None:
    """The pool's C steps on the table against the pool's Python form on a dict (the fallback), the same ops."""
    from kvproc.core import paged as paged_mod
    from kvproc.core.paged import PagedBlocks

    fast = PagedBlocks(64)
    saved = paged_mod.NATIVE
    paged_mod.NATIVE = None
    try:
        slow = PagedBlocks(64)
        assert isinstance(slow.index, dict)
    finally:
        paged_mod.NATIVE = saved
    steps = [([0, 1, 2], [KEYS[0], KEYS[1], KEYS[0]]), ([3, 4], [KEYS[1], KEYS[5]]), ([5, 6, 7], KEYS[80:83])]
    for pb in (fast, slow):
        pb.allocate(8)
    for ids, hashes in steps:
        fast.register(ids, hashes)
        paged_mod.NATIVE = None
        try:
            slow.register(ids, hashes)
        finally:
            paged_mod.NATIVE = saved
        assert fast.index == slow.index and fast.block_hash == slow.block_hash
    for ids in ([0, 3], [2, 5]):
        fast._unhash(ids)
        paged_mod.NATIVE = None
        try:
            slow._unhash(ids)
        finally:
            paged_mod.NATIVE = saved
        assert fast.index == slow.index and fast.block_hash == slow.block_hash
    assert fast.index == {KEYS[5]: 4, KEYS[81]: 6, KEYS[82]: 7}  # 1 displaced by 3, then 3, 2 and 5 evicted
    assert fast.match([KEYS[5], KEYS[81], KEYS[82], KEYS[0]]) == [4, 6, 7] and fast.match(KEYS[80:83]) == []


def test_untrack_atomic_takes_only_lists_of_bytes_ints_and_none_out_of_the_gc() -> None:
    """The pool's per-block lists leave the GC's scans (they cannot be in a cycle); anything that could is refused."""
    import gc

    from kvproc.core.paged import PagedBlocks

    pb = PagedBlocks(16)
    assert not gc.is_tracked(pb.free) and not gc.is_tracked(pb.block_hash.array)
    ids = pb.allocate(4)
    pb.register(ids, KEYS[:4])
    pb.release(ids)  # the LRU keeps the released ids as one run, a list of ints
    assert [list(r) for r in pb.inactive.runs.values()] == [ids[::-1]]
    assert not any(gc.is_tracked(r) for r in pb.inactive.runs.values())
    ok = [b"a", 1, None]
    N.untrack_atomic(ok)
    assert not gc.is_tracked(ok)
    for bad in ([b"a", []], [object()]):
        with pytest.raises(TypeError, match="only bytes, int, None"):
            N.untrack_atomic(bad)
        assert gc.is_tracked(bad)
    with pytest.raises(TypeError, match="takes a list"):
        N.untrack_atomic((1, 2))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=64), st.integers(0, 63),
       st.sampled_from([0, -1, 2**31 - 1, 2**31 - 2, 2**32 + 5, 7]), st.booleans())
def test_tokens_match_agrees_with_serialising_the_prompt_again(ids: list[int], at: int, value: int, data_too: bool):
    """`tokens_match` (PageHashes.covers' fast path) is True exactly when the slow comparison finds the ids in range
    and equal: a changed id (in or out of range, the pad id, one past 2**32) in the tokens, or in both, and a short
    `data`."""
    import numpy as np

    from kvproc.core.hashing import MAX_USER_TOKEN_ID, tokens_to_bytes

    data = tokens_to_bytes(ids)
    tokens = np.asarray(ids, dtype=np.int64)
    tokens[at % len(ids)] = value
    if data_too and 0 <= value < 2**31:
        data = data[: 4 * (at % len(ids))] + value.to_bytes(4, "little") + data[4 * (at % len(ids)) + 4:]
    try:
        slow = tokens_to_bytes(tokens) == data
    except ValueError:
        slow = False
    assert N.tokens_match(data, tokens, MAX_USER_TOKEN_ID) is slow
    assert N.tokens_match(data[:-4], tokens, MAX_USER_TOKEN_ID) is False  # data shorter than the tokens
    assert N.tokens_match(data, tokens.astype(np.int32), MAX_USER_TOKEN_ID) is False  # not int64: the slow way


def test_a_table_grown_into_its_own_mapping_keeps_every_entry() -> None:
    """Past 4 MiB (174 k entries: 2^18 buckets of 24 bytes) a table is its own populated mapping: growing into it,
    growing again, deleting and dropping it keep the dict's answers (and free the mapping, not the heap)."""
    import numpy as np

    n = 400_000  # grows through 2^18, 2^19 and 2^20 buckets
    raw = np.random.default_rng(3).bytes(16 * n)
    keys = [raw[16 * i:16 * i + 16] for i in range(n)]
    table = N.PrefixIndex()
    for i, k in enumerate(keys):
        table[k] = i
    assert len(table) == n
    assert table.match(keys[:1000]) == list(range(1000)) and table.get(keys[-1]) == n - 1
    for k in keys[::2]:
        del table[k]
    assert len(table) == n // 2 and table.get(keys[0]) is None and table[keys[1]] == 1
    assert all(table[keys[i]] == i for i in range(1, n, 2 * 997))
    del table  # the mapping goes back with the table (a heap free of it would abort the process)
