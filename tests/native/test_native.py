"""`kvproc.native._native` (the compiled hash chain and copy planner) agrees with hashlib and with plain-Python reference
loops on any input, and rejects bad input with an error instead of reading out of bounds."""

from __future__ import annotations

import hashlib
import os
import threading

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproc import native
from kvproc.core.hashing import BlockHasher, HashAlgorithm, HashScope, tokens_to_bytes
from kvproc.workers.copy_exec import plan_runs

# CI builds the module (gcc is part of the machine); a missing build must fail loudly there, not fall back silently.
if native._native is None and os.environ.get("KVPROC_ALLOW_PURE_PYTHON") != "1":
    pytest.fail("kvproc.native._native is not built (set KVPROC_ALLOW_PURE_PYTHON=1 where no C compiler exists)",
                pytrace=False)
N = native._native
needs_native = pytest.mark.skipif(N is None, reason="kvproc.native._native not built")


def reference_chain(data: bytes, page_bytes: int, seed: bytes) -> list[bytes]:
    h, out = seed, []
    for i in range(len(data) // page_bytes):
        h = hashlib.blake2b(h + data[i * page_bytes : (i + 1) * page_bytes], digest_size=16).digest()
        out.append(h)
    return out


def reference_family_chain(family: str, data: bytes, page_bytes: int, seed: bytes) -> list[bytes]:
    """The per-page hashlib / xxhash loop the C chains replace (`kvproc.core.hashing`'s fallback)."""
    fn = {"sha256-128": lambda b: hashlib.sha256(b).digest()[:16], "xxh3-128": xxhash.xxh3_128_digest}[family]
    h, out = seed, []
    for i in range(len(data) // page_bytes):
        h = fn(h + data[i * page_bytes : (i + 1) * page_bytes])
        out.append(h)
    return out


def reference_plan(src: list[int], dst: list[int], long_run: int):
    long_runs, gs, gd = [], [], []
    i = 0
    while i < len(src):
        k = 1
        while i + k < len(src) and src[i + k] == src[i] + k and dst[i + k] == dst[i] + k:
            k += 1
        if k >= long_run:
            long_runs.append((src[i], dst[i], k))
        else:
            gs += src[i : i + k]
            gd += dst[i : i + k]
        i += k
    bounds = (min(src), max(src), min(dst), max(dst)) if src else None
    return long_runs, gs, gd, bounds


@needs_native
@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=700), st.integers(1, 64))
def test_blake2b_equals_hashlib_at_every_length_and_digest_size(data, size):
    assert N.b2b(data, size) == hashlib.blake2b(data, digest_size=size).digest()


@needs_native
def test_blake2b_block_boundaries():
    for n in (0, 1, 111, 112, 127, 128, 129, 255, 256, 257, 1024):
        data = os.urandom(n)
        assert N.b2b(data, 16) == hashlib.blake2b(data, digest_size=16).digest(), n


@needs_native
@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=2000), st.sampled_from([4, 16, 64, 128, 256, 1024]), st.binary(min_size=16, max_size=16))
def test_chain_equals_the_hashlib_chain_for_any_page_size_and_parent(data, page_bytes, seed):
    assert N.blake2b_chain(data, page_bytes, seed) == reference_chain(data, page_bytes, seed)


@needs_native
@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 2), max_size=300), st.sampled_from([1, 4, 16, 32]),
       st.text(max_size=8))
def test_hasher_gives_the_same_hashes_as_the_pure_python_chain(tokens, page_tokens, salt):
    """What `BlockHasher.hash_prompt` returns with the native chain is byte-for-byte the hashlib chain (hashes saved
    by a store built without the module stay valid with it, and the other way round)."""
    hasher = BlockHasher(page_tokens, HashAlgorithm.BLAKE2B_128)  # our own C code; the other families: below
    scope = HashScope(cache_salt=salt)
    want = reference_chain(tokens_to_bytes(tokens), 4 * page_tokens, hasher.seed(scope))
    assert hasher.hash_prompt(tokens, scope) == want
    half = (len(tokens) // page_tokens // 2) * page_tokens
    if half:  # a chain continued from a parent, as a running request extends it
        head = hasher.hash_prompt(tokens[:half], scope)
        assert head + hasher.hash_prompt(tokens[half:], scope, parent=head[-1]) == want


@needs_native
def test_chain_rejects_bad_arguments():
    with pytest.raises(ValueError, match="seed must be 16 bytes"):
        N.blake2b_chain(b"x" * 64, 64, b"short")
    with pytest.raises(ValueError, match="page_bytes must be positive"):
        N.blake2b_chain(b"x" * 64, 0, b"s" * 16)
    with pytest.raises(TypeError):
        N.blake2b_chain("not bytes", 64, b"s" * 16)
    assert N.blake2b_chain(b"x" * 63, 64, b"s" * 16) == []  # no full page


@needs_native
def test_every_family_has_its_chain_in_c():
    """CI's Python has OpenSSL behind hashlib and the xxhash wheel: the SHA-256 and XXH3 chains must be installed
    there (`kvproc/native/digests.py`), not silently left to the per-page loop."""
    assert native.NATIVE_CHAINS == {"blake2b-128", "sha256-128", "xxh3-128"}
    for algorithm in HashAlgorithm:
        assert BlockHasher(16, algorithm)._native_chain is not None, algorithm


@needs_native
@pytest.mark.parametrize("family", ["sha256-128", "xxh3-128"])
@settings(max_examples=100, deadline=None)
@given(data=st.binary(max_size=2000), page_bytes=st.sampled_from([4, 16, 64, 128, 256, 1024]),
       seed=st.binary(min_size=16, max_size=16))
def test_sha256_and_xxh3_chains_equal_the_per_page_loop(family, data, page_bytes, seed):
    chain = N.sha256_chain if family == "sha256-128" else N.xxh3_chain
    assert chain(data, page_bytes, seed) == reference_family_chain(family, data, page_bytes, seed)


@needs_native
@pytest.mark.parametrize("algorithm", list(HashAlgorithm))
def test_hasher_gives_the_per_page_loop_s_hashes_for_every_family(algorithm):
    """A prompt hashes to the same bytes with the C chain as with the loop it replaced (a store built without the
    module reads a tier filled with it), here for every family, a chain continued from a parent included."""
    tokens = np.random.default_rng(1).integers(0, 2**31 - 1, 16 * 300 + 5).tolist()
    hasher = BlockHasher(16, algorithm)
    want = reference_family_chain(algorithm.value, tokens_to_bytes(tokens), 64, hasher.seed()) \
        if algorithm is not HashAlgorithm.BLAKE2B_128 else reference_chain(tokens_to_bytes(tokens), 64, hasher.seed())
    assert hasher.hash_prompt(tokens) == want
    head = hasher.hash_prompt(tokens[: 16 * 100])
    assert head + hasher.hash_prompt(tokens[16 * 100 :], parent=head[-1]) == want


@needs_native
@pytest.mark.parametrize("chain", ["sha256_chain", "xxh3_chain"])
def test_family_chains_reject_bad_arguments(chain):
    fn = getattr(N, chain)
    with pytest.raises(ValueError, match="seed must be 16 bytes"):
        fn(b"x" * 64, 64, b"short")
    with pytest.raises(ValueError, match="page_bytes must be positive"):
        fn(b"x" * 64, 0, b"s" * 16)
    with pytest.raises(TypeError):
        fn("not bytes", 64, b"s" * 16)
    assert fn(b"x" * 63, 64, b"s" * 16) == []


@needs_native
def test_chain_runs_without_the_gil_and_stays_correct_across_threads():
    data = os.urandom(64 * 2000)
    want = reference_chain(data, 64, b"\0" * 16)
    got: list[list[bytes]] = []

    def run() -> None:
        got.append(N.blake2b_chain(data, 64, b"\0" * 16))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == [want] * 4


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.data())
def test_copy_plan_equals_the_reference_split(data):
    n = data.draw(st.integers(0, 80))
    contiguous = data.draw(st.booleans())
    src = list(range(7, 7 + n)) if contiguous else data.draw(st.lists(st.integers(0, 200), min_size=n, max_size=n))
    dst = data.draw(st.lists(st.integers(0, 200), min_size=n, max_size=n)) if data.draw(st.booleans()) else \
        list(range(3, 3 + n))
    long_run = data.draw(st.integers(1, 6))
    want = reference_plan(src, dst, long_run)
    assert N.copy_plan(src, dst, long_run) == want
    runs_, gs, gd, bounds = plan_runs(src, dst, long_run)  # the wrapper the copy executor calls
    assert (runs_, gs.tolist(), gd.tolist(), bounds) == want
    assert gs.dtype == np.int64 and gd.dtype == np.int64


@needs_native
def test_copy_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="3 source ids against 2"):
        N.copy_plan([1, 2, 3], [1, 2], 4)
    with pytest.raises(TypeError):
        N.copy_plan([1, "x"], [1, 2], 4)
    with pytest.raises(TypeError):
        N.copy_plan(5, [1], 4)
    with pytest.raises(OverflowError):
        N.copy_plan([2**70], [1], 4)
    assert N.copy_plan(np.arange(5), np.arange(5), 4) == ([(0, 0, 5)], [], [], (0, 4, 0, 4))


def test_describe_names_the_form_in_use():
    assert native.describe() in ("native", "pure-python (turned off)", "pure-python (not built)")
    assert (native.NATIVE is None) == native.describe().startswith("pure-python")


@needs_native
@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=200))
def test_pack_tokens_equals_little_endian_uint32(tokens):
    assert N.pack_tokens(tokens, 2**31 - 1) == np.asarray(tokens, dtype="<u4").tobytes()
    assert tokens_to_bytes(tokens, max_id=2**31 - 1) == np.asarray(tokens, dtype="<i4").tobytes()


@needs_native
def test_pack_tokens_rejects_out_of_range_and_non_ints_and_the_hasher_names_it():
    for bad in ([1, -1], [2**31], [2**80], [1, 2.0], [True, "x"]):
        with pytest.raises((ValueError, TypeError)):
            N.pack_tokens(bad, 2**31 - 1)
    with pytest.raises(ValueError, match="token ids must lie in"):
        tokens_to_bytes([5, -3])
    with pytest.raises(ValueError, match="must be integers"):
        tokens_to_bytes([5, 2.5])


def test_the_pure_python_fallback_passes_the_hashing_and_copy_tests_and_hashes_the_same():
    """Where the module is not built (or `KVPROC_PURE_PYTHON=1`), the same tests pass (hashing, copy planning, the
    pool's and the host index's book-keeping, and their hypothesis state machines), and a prompt hashes to the same bytes as with the module: a store built without it reads a tier filled
    with it, and the other way round."""
    import subprocess
    import sys

    env = dict(os.environ, KVPROC_PURE_PYTHON="1")
    tests = ["tests/core/test_hashing.py", "tests/workers/test_copy_exec.py", "tests/core/test_pool.py", "tests/core/test_pool_properties.py",
             "tests/core/test_request_kv.py", "tests/tiers/test_host_index.py", "tests/tiers/test_host_index_properties.py",
             "tests/tiers/test_slot_table.py"]
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    code = ("from kvproc import native; from kvproc.core.hashing import BlockHasher; assert native.NATIVE is None; "
            "print(b''.join(BlockHasher(16).hash_prompt(list(range(5000)))).hex())")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == b"".join(BlockHasher(16).hash_prompt(list(range(5000)))).hex()


@needs_native
def test_paged_ops_change_nothing_when_one_id_is_bad():
    """Every C book-keeping op checks all ids before it writes: a bad id in the middle leaves the arrays as they were
    (the numpy forms fail the same way: a fancy index raises before assigning)."""
    from kvproc.core.paged import PagedBlocks, StaleBlockError

    pb = PagedBlocks(8)
    ids = pb.allocate(4)  # [0, 1, 2, 3]
    pb.register(ids[:2], [b"a" * 16, b"b" * 16])
    before = (pb.refcount.copy(), pb.generation.copy(), pb.hashed.copy(), list(pb.block_hash), dict(pb.index))

    def unchanged() -> bool:
        return (np.array_equal(pb.refcount, before[0]) and np.array_equal(pb.generation, before[1])
                and np.array_equal(pb.hashed, before[2]) and pb.block_hash == before[3] and pb.index == before[4])

    for bad in ([0, 99], [0, -1]):
        with pytest.raises(IndexError):
            N.paged_take(pb.refcount, pb.generation, bad)
        with pytest.raises(IndexError):
            N.paged_release(pb.refcount, pb.hashed, bad)
        with pytest.raises(IndexError):
            N.paged_register(pb.hashed, pb.block_hash.array, pb.index, [2] + bad[1:], [b"c" * 16, b"d" * 16])
        assert unchanged()
    with pytest.raises(RuntimeError, match="refcount underflow"):
        pb.release([0, 5])  # 5 is free: nothing may be released, not even 0
    assert unchanged()
    with pytest.raises(RuntimeError, match="acquire of free blocks"):
        pb.acquire([0, 6])
    assert unchanged()
    with pytest.raises(StaleBlockError, match=r"\[1\]"):
        pb.check([0, 1], np.array([pb.generation[0], pb.generation[1] + 1]))
    with pytest.raises(TypeError, match="1-d array of 4-byte"):
        N.paged_take(pb.generation, pb.generation, [0])
    with pytest.raises(TypeError, match="not bytes"):
        N.paged_register(pb.hashed, pb.block_hash.array, pb.index, [2], ["str"])
    with pytest.raises(TypeError, match="added must be a list"):
        N.paged_register(pb.hashed, pb.block_hash.array, pb.index, [2], [b"c" * 16], ())
    with pytest.raises(TypeError, match="removed must be a list"):
        N.paged_unhash(pb.hashed, pb.block_hash.array, pb.index, [0], ())
    assert unchanged()


@needs_native
@pytest.mark.parametrize("keys", ["array", "list"])
def test_paged_register_and_unhash_report_the_keys_they_added_and_removed(keys: str):
    """The optional output lists (KV events): positions of keys new to the index, keys whose entry went; a key
    already indexed (a duplicate) and a displaced block's eviction report nothing. The same with the pool's per-block
    key array and with a list of bytes (what the ops took before the array, still taken: bench/device_events_cost.py)."""
    from kvproc.core.paged import PagedBlocks

    pb = PagedBlocks(8)
    bh = pb.block_hash.array if keys == "array" else [None] * 8
    a, b = b"a" * 16, b"b" * 16
    added: list[int] = []
    N.paged_register(pb.hashed, bh, pb.index, [0, 1, 2], [a, b, a], added)
    assert added == [0, 1] and pb.index == {a: 2, b: 1}  # block 2 displaced block 0 under key a
    added = []
    N.paged_register(pb.hashed, bh, pb.index, [0, 3], [b"z" * 16, b], added)  # 0 is hashed: skipped
    assert added == [] and pb.index == {a: 2, b: 3}
    if keys == "array":
        assert pb.block_hash[:4] == [a, b, a, b]
    removed: list[bytes] = []
    N.paged_unhash(pb.hashed, bh, pb.index, [0, 1], removed)  # both displaced: no key leaves
    assert removed == [] and pb.index == {a: 2, b: 3}
    N.paged_unhash(pb.hashed, bh, pb.index, [2, 3], removed)
    assert removed == [a, b] and pb.index == {}
    assert not pb.hashed.any()


@needs_native
def test_paged_register_refuses_a_key_buffer_not_made_of_16_byte_keys():
    from kvproc.core.paged import PagedBlocks

    pb = PagedBlocks(8)
    with pytest.raises(TypeError, match="16-byte keys"):
        N.paged_register(pb.hashed, np.zeros(8 * 16 + 1, dtype=np.uint8), pb.index, [0], [b"a" * 16])
    with pytest.raises(IndexError):  # a key buffer shorter than the pool bounds the ids like the list did
        N.paged_register(pb.hashed, np.zeros(4 * 16, dtype=np.uint8), pb.index, [5], [b"a" * 16])
    assert not pb.hashed.any() and len(pb.index) == 0


def reference_rows(dst: np.ndarray, dstride: int, dids: list[int], src: np.ndarray, sstride: int, sids: list[int],
                   row: int) -> None:
    for d, s in zip(dids, sids):
        dst[d * dstride : d * dstride + row] = src[s * sstride : s * sstride + row]


@needs_native
@settings(max_examples=200, deadline=None)
@given(st.data())
def test_copy_rows_moves_what_a_row_by_row_loop_moves_and_nothing_else(data):
    """Packed rows (runs become one memmove) and strided rows (padding between them never written), ids in runs or
    scattered, repeated destinations included (the later row wins, as in the loop)."""
    row = data.draw(st.integers(1, 24))
    dstride = row + data.draw(st.sampled_from([0, 0, 3]))
    sstride = row + data.draw(st.sampled_from([0, 0, 5]))
    nd, ns = data.draw(st.integers(1, 40)), data.draw(st.integers(1, 40))
    n = data.draw(st.integers(0, 30))
    run = data.draw(st.booleans()) and n <= min(nd, ns)
    d0, s0 = data.draw(st.integers(0, nd - n if run else 0)), data.draw(st.integers(0, ns - n if run else 0))
    dids = list(range(d0, d0 + n)) if run else data.draw(st.lists(st.integers(0, nd - 1), min_size=n, max_size=n))
    sids = list(range(s0, s0 + n)) if run else data.draw(st.lists(st.integers(0, ns - 1), min_size=n, max_size=n))
    rng = np.random.default_rng(n)
    src = rng.integers(0, 256, ns * sstride, dtype=np.uint8)
    dst = rng.integers(0, 256, nd * dstride, dtype=np.uint8)
    want = dst.copy()
    reference_rows(want, dstride, dids, src, sstride, sids, row)
    assert N.copy_rows(dst, dstride, dids, src, sstride, np.asarray(sids), row) == n * row
    assert np.array_equal(dst, want)


@needs_native
def test_copy_rows_checks_every_id_before_any_byte_moves():
    src = np.arange(64, dtype=np.uint8)
    dst = np.zeros(64, dtype=np.uint8)
    # the last row of a buffer whose length is not a multiple of the stride still fits: (len - row) // stride
    assert N.copy_rows(dst[:60], 16, [3], src, 16, [0], 12) == 12 and dst[48:60].tolist() == list(range(12))
    dst[:] = 0
    for dids, sids in (([0, 4], [1, 2]), ([0, 1], [1, -1]), ([0, 1], [2**40, 0])):
        with pytest.raises(IndexError, match="ids out of range"):
            N.copy_rows(dst, 16, dids, src, 16, sids, 16)
        assert not dst.any()
    with pytest.raises(ValueError, match="2 destination ids against 1"):
        N.copy_rows(dst, 16, [0, 1], src, 16, [0], 16)
    with pytest.raises(ValueError, match="bad geometry"):
        N.copy_rows(dst, 8, [0], src, 16, [0], 16)  # a row longer than the destination's stride
    with pytest.raises((TypeError, BufferError)):
        N.copy_rows(src.tobytes(), 16, [0], src, 16, [0], 16)  # read-only destination
    with pytest.raises(TypeError):
        N.copy_rows(dst, 16, [0.5], src, 16, [0], 16)


@needs_native
def test_copy_rows_releases_the_gil_for_a_big_copy_and_gets_the_right_bytes():
    """>= 1 MiB copies run without the GIL (the executor's two copy threads split those): two threads copying halves
    at once still land every row."""
    row, n = 64 << 10, 64
    src = np.random.default_rng(1).integers(0, 256, n * row, dtype=np.uint8)
    dst = np.zeros_like(src)
    perm = np.random.default_rng(2).permutation(n).tolist()
    halves = [(perm[: n // 2], list(range(n // 2))), (perm[n // 2 :], list(range(n // 2, n)))]
    ts = [threading.Thread(target=N.copy_rows, args=(dst, row, d, src, row, s, row)) for d, s in halves]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert np.array_equal(dst.reshape(n, row)[perm], src.reshape(n, row))


@needs_native
def test_paged_release_packed_gives_the_same_blocks_as_the_list_form():
    """`packed=True` returns the hashed zeros as one bytes of int64 (the LRU's run, no int per id), in the list form's
    order (last id first); the unhashed ones still come as a list, and an underflow still changes nothing."""
    from kvproc.core.paged import PagedBlocks

    forms = []
    for packed in (False, True):
        pb = PagedBlocks(8)
        ids = pb.allocate(6)
        pb.register(ids[:4], [bytes([i]) * 16 for i in range(4)])
        pb.acquire(ids[1:2])  # block 1 keeps a reference: not released to zero
        hz, uz, bad = N.paged_release(pb.refcount, pb.hashed, ids, packed)
        assert bad is None
        forms.append((np.frombuffer(hz, dtype=np.int64).tolist() if packed else hz, uz, pb.refcount.tolist()))
        before = pb.refcount.copy()
        assert N.paged_release(pb.refcount, pb.hashed, [ids[1], ids[5]], packed)[2] == [ids[5]]
        assert np.array_equal(pb.refcount, before)
    assert forms[0] == forms[1] and forms[0][0] == [3, 2, 0] and forms[0][1] == [5, 4]


@needs_native
def test_ids_given_as_an_int64_array_read_as_the_list_does():
    """The C ops read a 1-d int64 array in one copy (the LRU's packed runs); other arrays and sequences as before."""
    stamp = np.full(8, -1, dtype=np.int64)
    assert N.lru_stamp(stamp, np.array([1, 3, 5], dtype=np.int64), 7) == 0
    assert N.lru_stamp(stamp, [3, 4], 8) == 1
    assert N.lru_stamp(stamp, np.array([5, 6], dtype=np.int32), 9) == 1  # another dtype: the sequence path
    assert N.lru_stamp(stamp, np.arange(8, dtype=np.int64)[::3], 10) == 2  # not contiguous: the sequence path
    assert stamp.tolist() == [10, 7, -1, 10, 8, 9, 10, -1]
    with pytest.raises(IndexError):
        N.lru_stamp(stamp, np.array([8], dtype=np.int64), 11)
    assert N.lru_stamp(stamp, np.zeros(0, dtype=np.int64), 12) == 0


@needs_native
@pytest.mark.parametrize("eviction", ["lru", "lrfu"])
def test_released_runs_evict_in_the_same_order_as_before(eviction: str):
    """The pool's releases reach the eviction policy as packed int64 runs: eviction still takes the oldest release
    first and a request's tail before its head (what the list runs did)."""
    from kvproc.core.paged import PagedBlocks

    pb = PagedBlocks(10, eviction)
    a, b = pb.allocate(3), pb.allocate(3)
    pb.register(a, [bytes([1, i]) * 8 for i in range(3)])
    pb.register(b, [bytes([2, i]) * 8 for i in range(3)])
    pb.release(a)
    pb.release(b)
    if eviction == "lru":
        assert all(type(r) is np.ndarray for r in pb.inactive.runs.values())
        assert list(pb.inactive) == a[::-1] + b[::-1]
    taken = pb.allocate(4 + 2)  # the 4 free blocks, then two evicted
    assert taken[4:] == [a[2], a[1]]
