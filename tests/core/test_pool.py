"""BlockPool rules: states, LRU, generations, probe caps and miss reasons, holds, reservations, pins."""

import gc

import pytest

from kvproc import (
    BlockPool,
    GroupKind,
    GroupSpec,
    HoldConsumedError,
    KvSpec,
    MissReason,
    PoolExhaustedError,
    RequestKv,
    ReusePolicy,
    StaleBlockError,
)
from tests.core.conftest import PAGE, bounded_pool, paged_pool, run_prompt


def test_allocation_is_all_or_nothing():
    pool = paged_pool(4)
    with pool.lock:
        pool.paged.allocate(3)
        with pytest.raises(PoolExhaustedError):
            pool.paged.allocate(2)
        assert pool.paged.available == 1


def test_sealed_pages_become_inactive_and_matchable_after_release():
    pool = paged_pool()
    run_prompt(pool, "a", list(range(10)))
    st = pool.stats()
    assert st["inactive_blocks"] == 2 and st["indexed_pages"] == 2 and st["active_blocks"] == 0


def test_inactive_blocks_are_evicted_lru_tail_first():
    pool = paged_pool(4)
    kv = run_prompt(pool, "a", list(range(16)))  # 4 sealed pages, all inactive
    hashes = kv.page_hashes
    with pool.lock:
        pool.paged.allocate(1)
    # the tail page went first: the head of the chain still matches
    assert pool.paged.match(hashes) == pool.paged.match(hashes[:3])
    assert len(pool.paged.match(hashes)) == 3


def test_stale_generation_is_rejected():
    pool = paged_pool(2)
    kv = run_prompt(pool, "a", list(range(8)))
    hold = pool.probe(kv.page_hashes, 8, ReusePolicy.FULL_PAGES)
    ids, gens = hold.block_ids, hold.generations
    hold.release()
    with pool.lock:
        pool.paged.allocate(2)  # evicts and reuses both blocks: generations change
    with pytest.raises(StaleBlockError):
        pool.check_blocks(ids, gens)


def test_probe_caps_reuse_so_one_token_is_computed():
    pool = paged_pool()
    kv = run_prompt(pool, "a", list(range(8)))
    capped = pool.probe(kv.page_hashes, 8)
    assert capped.num_blocks == 1  # (8-1)//4
    full = pool.probe(kv.page_hashes, 8, ReusePolicy.FULL_PAGES)
    assert full.num_blocks == 2


def test_probe_reports_why_it_missed():
    pool = paged_pool()
    assert pool.probe(RequestKv(pool, "x", list(range(8)), 0).page_hashes, 8).reason is MissReason.NO_ENTRY
    kv = run_prompt(pool, "a", list(range(4)))
    below = pool.probe(kv.page_hashes, 4)
    assert below.num_blocks == 0 and below.reason is MissReason.BELOW_REUSE_CAP
    hit = pool.probe(RequestKv(pool, "b", list(range(6)), 0).page_hashes, 6)
    assert hit.reason is MissReason.HIT and hit.num_tokens == PAGE


def test_prefix_caching_off_misses_with_its_reason():
    spec = KvSpec(4, (GroupSpec("kv", GroupKind.PAGED), GroupSpec("d", GroupKind.BOUNDED, checkpointable=False)))
    pool = BlockPool(spec, 8, bounded_slots={"d": 3}, live_slots=2)
    kv = run_prompt(pool, "a", list(range(8)))
    hold = pool.probe(kv.page_hashes, 9)
    assert hold.num_blocks == 0 and hold.reason is MissReason.PREFIX_CACHING_OFF
    assert pool.stats()["indexed_pages"] == 0


def test_hold_survives_eviction_until_consumed():
    pool = paged_pool(4)
    kv = run_prompt(pool, "a", list(range(8)))
    hold = pool.probe(kv.page_hashes, 9)
    assert hold.num_blocks == 2
    # fill the pool: only the 2 unheld blocks can be taken; the held ones are not evictable
    with pool.lock:
        taken = pool.paged.allocate(2)
        with pytest.raises(PoolExhaustedError):
            pool.paged.allocate(1)
        pool.paged.release(taken)
    pool.check_hold(hold)
    kv2 = RequestKv(pool, "b", list(range(8)) + [1], 0)
    assert kv2.try_admit(hold.num_blocks)
    kv2.match_and_add_prefix(hold)
    assert kv2.num_computed == 8


def test_consumed_hold_cannot_be_used_again():
    pool = paged_pool()
    kv = run_prompt(pool, "a", list(range(8)))
    hold = pool.probe(kv.page_hashes, 9)
    r = RequestKv(pool, "b", list(range(9)), 0)
    assert r.try_admit(hold.num_blocks)
    r.match_and_add_prefix(hold)
    assert hold.consumed
    with pytest.raises(HoldConsumedError):
        _ = hold.block_ids
    r2 = RequestKv(pool, "c", list(range(9)), 0)
    assert r2.try_admit(0)
    with pytest.raises(HoldConsumedError):
        r2.match_and_add_prefix(hold)
    hold.release()  # idempotent, nothing left to release


def test_hold_is_released_on_garbage_collection():
    pool = paged_pool()
    kv = run_prompt(pool, "a", list(range(8)))
    hold = pool.probe(kv.page_hashes, 9)
    assert pool.stats()["active_blocks"] == 2
    del hold
    gc.collect()
    pool.drain_deferred()
    assert pool.stats()["active_blocks"] == 0


def test_reserve_declines_into_the_entitled_floor():
    pool = paged_pool(10)
    big = RequestKv(pool, "big", list(range(24)), 8)  # 8 blocks of lifetime
    assert big.try_admit(0)
    assert pool.entitled == 8
    assert pool.reserve_loaded_blocks(3) is None  # 10 available < 3 + 8
    res = pool.reserve_loaded_blocks(2)
    assert res is not None and len(res.block_ids) == 2
    # the admitted request can still draw its whole lifetime
    big.schedule(24)
    big.apply(list(range(8)))
    big.schedule(8)
    big.apply()
    res.release()
    big.release()
    assert pool.entitled == 0 and pool.available == 10


def test_probe_does_not_hold_evictable_blocks_below_the_floor():
    pool = paged_pool(6)
    kv = run_prompt(pool, "a", list(range(16)))  # 4 inactive sealed pages
    admitted = RequestKv(pool, "b", [99] * 20, 0)
    assert admitted.try_admit(0)  # entitled 5 of 6 available
    hold = pool.probe(kv.page_hashes, 17)
    assert hold.num_blocks == 1 and hold.reason is MissReason.HIT
    assert pool.available >= pool.entitled
    hold.release()
    admitted.release()
    hold2 = pool.probe(kv.page_hashes, 17)
    assert hold2.num_blocks == 4


def test_commit_loaded_blocks_registers_and_extends_the_hold():
    pool = paged_pool(16)
    tokens = list(range(16))
    kv = RequestKv(pool, "x", tokens, 0)
    hashes = kv.page_hashes
    hold = pool.probe(hashes, 17)
    assert hold.num_blocks == 0
    res = pool.reserve_loaded_blocks(4)
    assert res is not None
    pool.commit_loaded_blocks(res, hold, hashes[:4])
    assert hold.num_blocks == 4 and res.settled
    # restore = put it back in the index and let the normal match find it
    again = pool.probe(hashes, 17)
    assert again.block_ids == hold.block_ids


def test_commit_of_an_already_committed_hash_displaces_the_older_identical_copy():
    pool = paged_pool(16)
    hashes = RequestKv(pool, "x", list(range(8)), 0).page_hashes
    h1, h2 = pool.probe(hashes, 9), pool.probe(hashes, 9)
    r1, r2 = pool.reserve_loaded_blocks(2), pool.reserve_loaded_blocks(2)
    pool.commit_loaded_blocks(r1, h1, hashes)
    pool.commit_loaded_blocks(r2, h2, hashes)
    assert h1.num_blocks == h2.num_blocks == 2 and set(h1.block_ids).isdisjoint(h2.block_ids)
    assert pool.probe(hashes, 9, ReusePolicy.FULL_PAGES).block_ids == h2.block_ids
    h1.release(), h2.release()
    assert pool.stats()["active_blocks"] == 0
    # the displaced copy ages out of the LRU like any other block, and never shadows the index
    with pool.lock:
        pool.paged.allocate(16)
    assert pool.stats()["indexed_pages"] == 0


def test_commit_without_the_bounded_staging_slots_is_refused():
    pool = bounded_pool()
    hashes = RequestKv(pool, "x", list(range(8)), 0).page_hashes
    hold = pool.probe(hashes, 9)
    res = pool.reserve_loaded_blocks(2)
    with pytest.raises(ValueError, match="staging slot for bounded group"):
        pool.commit_loaded_blocks(res, hold, hashes)
    assert pool.stats()["active_blocks"] == 0


def test_pinned_blocks_are_counted_and_not_evictable():
    pool = paged_pool(4)
    kv = run_prompt(pool, "a", list(range(16)), release=False)
    pin = pool.pin(kv.block_ids[:2], kv.block_generations()[:2])
    kv.release()
    assert pool.pinned_blocks() == 2
    assert pool.available == 2
    with pool.lock:
        with pytest.raises(PoolExhaustedError):
            pool.paged.allocate(3)
    pin.release()
    pin.release()
    assert pool.pinned_blocks() == 0 and pool.available == 4


def test_pin_with_a_stale_generation_is_rejected():
    pool = paged_pool(2)
    kv = run_prompt(pool, "a", list(range(8)), release=False)
    ids, gens = kv.block_ids, kv.block_generations()
    kv.release()
    with pool.lock:
        pool.paged.allocate(2)
    with pytest.raises(StaleBlockError):
        pool.pin(ids, gens)


def test_allocate_hands_back_the_new_generations_of_exactly_the_blocks_it_took() -> None:
    pool = paged_pool(8)
    first = pool.paged.allocate(8)
    pool.paged.register(first, [bytes([i]) * 16 for i in range(8)])
    pool.paged.release(first)  # all inactive now: the next allocation evicts (and bumps) them again
    ids, gens = pool.paged.allocate_with_generations(5)
    assert gens.tolist() == pool.paged.generations(ids).tolist() and len(ids) == 5
    gens[:] = -1  # the caller's own copy, not a view of the pool's array
    assert (pool.paged.generation >= 0).all()
