"""RequestKv: admission, steps, padding, release; bounded checkpoints by copy and the one checkpoint index."""

import dataclasses
import gc

import pytest

from kvproc import (
    DEFAULT_SCOPE,
    PAD_TOKEN_ID,
    BlockHasher,
    CopyKind,
    LifetimeExceededError,
    MissReason,
    RequestKv,
    RequestStateError,
    ReusePolicy,
    StaleBlockError,
)
from tests.core.conftest import PAGE, bounded_pool, paged_pool, run_prompt


def test_prompt_hashes_handed_in_must_cover_every_full_page_of_the_prompt():
    pool = paged_pool()
    own = pool.hasher.hash_prompt(list(range(10)))  # 2 full pages of 4 tokens
    assert RequestKv(pool, "b", list(range(10)), 0, prompt_hashes=own).page_hashes == own
    short = pool.hasher.hash_prompt(list(range(4)))
    with pytest.raises(ValueError, match="1 prompt hashes for 2 full pages of 10 tokens"):
        RequestKv(pool, "c", list(range(10)), 0, prompt_hashes=short)


def test_prompt_hashes_of_another_prompt_are_refused_not_trusted():
    """Hashes of prompt A with the tokens of prompt B would index B's KV under A's keys: A's next reader would be
    served B's KV. Only the length used to be checked; now the chain is checked against the tokens it names."""
    pool = paged_pool()
    a = list(range(12))
    b = a[:4] + [99, 98, 97, 96] + a[8:]  # same first and last page, another middle page
    hashes_a = pool.hasher.hash_prompt(a)
    with pytest.raises(ValueError, match="other tokens than this request's prompt"):
        RequestKv(pool, "b", b, 0, prompt_hashes=hashes_a)
    with pytest.raises(ValueError, match="scope"):
        RequestKv(pool, "s", a, 0, prompt_hashes=hashes_a, scope=dataclasses.replace(DEFAULT_SCOPE, cache_salt="x"))
    with pytest.raises(TypeError, match="KvPrefix.page_hashes"):  # a plain list cannot be checked: refused
        RequestKv(pool, "l", a, 0, prompt_hashes=list(hashes_a))
    other_model = BlockHasher(PAGE, namespace="another-model")
    with pytest.raises(ValueError, match="another hasher"):
        RequestKv(pool, "m", a, 0, prompt_hashes=other_model.hash_prompt(a))
    continued = pool.hasher.hash_prompt(a, parent=hashes_a[0])
    with pytest.raises(ValueError, match="continue another chain"):
        RequestKv(pool, "c", a, 0, prompt_hashes=continued)
    assert RequestKv(pool, "a", a, 0, prompt_hashes=hashes_a).page_hashes == hashes_a


def test_lifetime_is_frozen_at_creation():
    pool = paged_pool()
    kv = RequestKv(pool, "a", list(range(10)), 7)
    assert kv.lifetime_blocks == 5  # ceil(17/4)
    kv.append_tokens([1] * 40)
    assert kv.lifetime_blocks == 5


def test_admission_is_honor_or_reject():
    pool = paged_pool(8)
    a = RequestKv(pool, "a", list(range(20)), 8)  # 7 blocks
    b = RequestKv(pool, "b", list(range(8)), 0)  # 2 blocks
    assert a.try_admit()
    assert not b.try_admit()  # 8 - 7 = 1 < 2
    assert pool.stats()["admission_rejected"] == 1
    a.release()
    assert b.try_admit()


def test_admission_is_credited_by_the_prefix_hold():
    pool = paged_pool(4)
    kv = run_prompt(pool, "a", list(range(12)))  # 3 sealed pages
    r = RequestKv(pool, "b", list(range(12)) + [5, 6, 7], 1)  # lifetime 4
    hold = pool.probe(r.page_hashes, r.num_tokens)
    assert hold.num_blocks == 3
    assert not RequestKv(pool, "c", [9] * 8, 0).try_admit()  # 2 needed, only 1 block left outside the hold
    assert r.try_admit(hold.num_blocks)
    r.match_and_add_prefix(hold)
    r.schedule(3)
    r.apply([1])
    assert r.num_computed == 15 and pool.entitled == 0
    del kv


def test_draw_beyond_lifetime_is_refused():
    pool = paged_pool()
    kv = RequestKv(pool, "a", list(range(4)), 0)
    assert kv.try_admit()
    kv.schedule(4)
    kv.apply([1])  # a sampled token beyond max_output_tokens
    with pytest.raises(LifetimeExceededError):
        kv.schedule(1)


def test_revert_returns_the_drawn_blocks_and_the_entitlement():
    pool = paged_pool()
    kv = RequestKv(pool, "a", list(range(9)), 3)
    assert kv.try_admit()
    before = (pool.available, pool.entitled)
    kv.schedule(9)
    assert pool.entitled == before[1] - 3
    kv.revert()
    assert (pool.available, pool.entitled) == before and kv.num_computed == 0


def test_schedule_requires_admission_and_one_step_at_a_time():
    pool = paged_pool()
    kv = RequestKv(pool, "a", list(range(8)), 2)
    with pytest.raises(RequestStateError, match="admitted"):
        kv.schedule(1)
    assert kv.try_admit()
    kv.schedule(4)
    with pytest.raises(RequestStateError, match="already scheduled"):
        kv.schedule(1)


def test_decode_fills_pages_that_become_matchable():
    pool = paged_pool()
    kv = RequestKv(pool, "a", list(range(6)), 4)
    assert kv.try_admit()
    kv.schedule(6)
    kv.apply([100])
    for t in (101, 102):
        kv.schedule(1)
        kv.apply([t])
    assert kv.num_computed == 8
    toks = list(range(6)) + [100, 101]
    probe = pool.probe(RequestKv(pool, "q", toks, 0).page_hashes, 8, ReusePolicy.FULL_PAGES)
    assert probe.num_blocks == 2 and probe.block_ids == kv.block_ids[:2]


def test_pad_to_boundary_names_the_last_page():
    pool = paged_pool()
    kv = RequestKv(pool, "a", list(range(6)), 2)
    assert kv.try_admit()
    kv.schedule(6)
    kv.apply()
    assert kv.pad_to_boundary() == 2
    assert kv.tokens[-2:] == [PAD_TOKEN_ID] * 2 and kv.num_computed == 8
    padded = pool.hasher.hash_prompt(list(range(6)) + [PAD_TOKEN_ID] * 2, pad_tail=True)  # the consumer's chain
    hold = pool.probe(padded, 8, ReusePolicy.FULL_PAGES)
    assert hold.num_blocks == 2
    with pytest.raises(ValueError, match="reserved pad id"):  # a user prompt cannot name the padded page
        RequestKv(pool, "d", list(range(6)) + [PAD_TOKEN_ID] * 2, 0)


def test_release_on_garbage_collection_returns_everything():
    pool = paged_pool(8)
    kv = RequestKv(pool, "a", list(range(10)), 2)
    assert kv.try_admit()
    kv.schedule(10)
    kv.apply()
    del kv
    gc.collect()
    pool.drain_deferred()
    assert pool.entitled == 0 and pool.available == 8
    assert pool.stats()["requests_released_by_gc"] == 1


def test_release_is_idempotent():
    pool = paged_pool()
    kv = run_prompt(pool, "a", list(range(8)), 3)
    kv.release()
    assert pool.entitled == 0 and pool.recompute_entitled() == 0


# -- bounded groups and checkpoints ------------------------------------------------------------------------------


def computed(pool, rid, tokens, max_out=4):
    kv = RequestKv(pool, rid, tokens, max_out)
    hold = pool.probe(kv.page_hashes, kv.num_tokens)
    assert kv.try_admit(hold.num_blocks)
    orders = kv.match_and_add_prefix(hold)
    for o in orders:
        pool.fence(o)
    kv.schedule(kv.num_tokens - kv.num_computed)
    kv.apply()
    return kv


def test_bounded_checkpoint_exists_only_after_its_copy_is_fenced():
    pool = bounded_pool()
    kv = computed(pool, "a", list(range(8)))
    (order,) = kv.seal_by_copy()
    assert order.kind is CopyKind.SEAL and order.src_slot == kv.live_slots["state"]
    probe_toks = list(range(8)) + [1]
    q = RequestKv(pool, "q", probe_toks, 0)
    before = pool.probe(q.page_hashes, 9)
    assert before.num_blocks == 0 and before.reason is MissReason.ENTRY_INCOMPLETE
    before.release()
    kv.append_tokens([1])
    with pytest.raises(RequestStateError, match="not fenced"):
        kv.schedule(1)  # the step would write the live slot the copy is still reading
    pool.fence(order)
    after = pool.probe(q.page_hashes, 9)
    assert after.num_blocks == 2 and set(after.artifacts) == {"state"}


def test_hit_restores_the_deepest_complete_checkpoint_and_returns_restore_orders():
    pool = bounded_pool()
    kv = RequestKv(pool, "a", list(range(16)), 0)
    assert kv.try_admit()
    # checkpoints at 4 and 12 tokens, none at 8 or 16
    kv.schedule(4), kv.apply()
    for o in kv.seal_by_copy():
        pool.fence(o)
    kv.schedule(8), kv.apply()
    for o in kv.seal_by_copy():
        pool.fence(o)
    kv.schedule(4), kv.apply()
    kv.release()
    r = RequestKv(pool, "b", list(range(16)) + [7], 0)
    hold = pool.probe(r.page_hashes, 17)
    assert hold.matched_pages == 4 and hold.num_blocks == 3  # deepest checkpoint at 12 tokens
    assert r.try_admit(hold.num_blocks)
    (restore,) = r.match_and_add_prefix(hold)
    assert restore.kind is CopyKind.RESTORE and restore.dst_slot == r.live_slots["state"]
    with pytest.raises(RequestStateError, match="not fenced"):
        r.schedule(1)
    pool.fence(restore)
    r.schedule(5)
    r.apply()


def test_missing_optional_group_keeps_the_hit():
    pool = bounded_pool(optional_extra=True)
    kv = computed(pool, "a", list(range(8)))
    orders = kv.seal_by_copy()
    assert {o.group for o in orders} == {"state", "extra"}
    for o in orders:
        pool.fence(o, ok=(o.group == "state"))  # the optional copy failed
    hold = pool.probe(RequestKv(pool, "q", list(range(9)), 0).page_hashes, 9)
    assert hold.num_blocks == 2 and set(hold.artifacts) == {"state"}


def test_missing_required_group_invalidates_the_checkpoint():
    pool = bounded_pool(optional_extra=True)
    kv = computed(pool, "a", list(range(8)))
    for o in kv.seal_by_copy():
        pool.fence(o, ok=(o.group == "extra"))
    hold = pool.probe(RequestKv(pool, "q", list(range(9)), 0).page_hashes, 9)
    assert hold.num_blocks == 0 and hold.reason is MissReason.ENTRY_INCOMPLETE


def test_seal_by_copy_skips_an_existing_checkpoint_and_sheds_without_staging():
    pool = bounded_pool(slots=3, live=2)  # one staging slot
    a = computed(pool, "a", list(range(8)))
    b = computed(pool, "b", list(range(8)))
    (o,) = a.seal_by_copy()
    assert b.seal_by_copy() == []  # no staging slot left while a's copy is pending
    assert pool.stats()["seal_copies_shed"] == 1
    pool.fence(o)
    assert b.seal_by_copy() == []  # the checkpoint exists already


def test_release_with_an_unfenced_copy_keeps_the_live_slot_until_it_settles():
    pool = bounded_pool(live=1)
    a = computed(pool, "a", list(range(8)))
    (o,) = a.seal_by_copy()
    a.release()
    assert not RequestKv(pool, "b", [1] * 4, 0).try_admit()  # the only live slot is still being read
    pool.fence(o)
    assert RequestKv(pool, "c", [1] * 4, 0).try_admit()


def test_fence_of_a_reused_staging_slot_is_detected():
    pool = bounded_pool()
    a = computed(pool, "a", list(range(8)))
    (o,) = a.seal_by_copy()
    pool.fence(o)
    with pytest.raises(KeyError):
        pool.fence(o)
    # A second order for the same staging slot, issued before the slot was reused, must not fence after reuse.
    (o2,) = computed(pool, "b", list(range(4)) + [9] * 4).seal_by_copy()
    forged = dataclasses.replace(o2, staging_generation=o2.staging_generation - 1)
    pool._orders[forged.order_id] = pool._orders.pop(o2.order_id)
    with pytest.raises(StaleBlockError):
        pool.fence(forged)
