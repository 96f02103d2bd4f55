"""Every handle the API hands out is refused by any owner but its own (issue 39, item 1).

Two stores of the same model in one process, two ranks each: four pools whose hashes of a prompt are equal, so only
ownership tells their handles apart. A hold of rank 0 adopted by rank 1's request used to be accepted (16 tokens
"computed" over blocks holding another prompt's bytes, a refcount underflow at release), and across two stores not
even that. The property draws a handle (prefix hold, reservation, bounded copy order, seal cursor, request) from one
owner, uses it with another in every way the API takes it back, and checks that each use raises
`ForeignHandleError` before anything moves, that the handle still works for its owner, and that afterwards nothing is
held anywhere.
"""

from __future__ import annotations

from typing import Iterator

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproc import (
    DEFAULT_SCOPE,
    ForeignHandleError,
    HandoffEnvelope,
    HashScope,
    KvStore,
    RequestKv,
    SaveClass,
    SealCursor,
    chain_key,
    check_envelope,
    validate_layout,
)
from tests.hypothesis_budget import examples
from tests.store.conftest import PAGE, BytesModel

PROMPT = list(range(100, 100 + 4 * PAGE))  # four full pages
OWNERS = [(s, r) for s in range(2) for r in range(2)]  # (store, rank)


@pytest.fixture(scope="module")
def stores() -> Iterator[list[KvStore]]:
    model = BytesModel(32, bounded=True)
    layout = validate_layout(model.spec(), model.arenas(0))
    made = [KvStore([layout, layout], live_slots=2) for _ in range(2)]
    yield made
    for s in made:
        s.close()


def _baseline(stores: list[KvStore]) -> list[dict[str, int]]:
    keys = ("active_blocks", "entitled_blocks", "pinned_blocks", "admitted_requests", "open_copy_orders",
            "state_live_free", "state_staging_available")
    out = []
    for s in stores:
        for p in s.pools:
            p.evict_cached()
            st_ = p.stats()
            out.append({k: st_[k] for k in keys})
    return out


def _computed(store: KvStore, rank: int, rid: str) -> RequestKv:
    """An admitted request of `rank` with the prompt computed (its pages sealed in that pool)."""
    kv = RequestKv(store.pools[rank], rid, PROMPT, 4)
    assert kv.try_admit()
    kv.schedule(len(PROMPT))
    kv.apply()
    return kv


def _refused(call: object, *args: object) -> None:
    with pytest.raises(ForeignHandleError):
        call(*args)  # type: ignore[operator]


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kind=st.sampled_from(["hold", "reservation", "order", "cursor", "request"]),
       pair=st.permutations(OWNERS).map(lambda p: (p[0], p[1])))
def test_a_handle_is_refused_by_every_other_owner(stores: list[KvStore], kind: str,
                                                  pair: tuple[tuple[int, int], tuple[int, int]]) -> None:
    before = _baseline(stores)
    (si, ri), (sj, rj) = pair
    owner, other = stores[si], stores[sj]
    pool, wrong = owner.pools[ri], other.pools[rj]

    if kind == "hold":
        seed = _computed(owner, ri, "seed")
        for o in seed.seal_by_copy():  # the bounded state's checkpoint at the prompt's end (book-keeping only)
            pool.fence(o)
        seed.release()
        longer = PROMPT + [1]  # one token past the sealed pages: every page is reusable
        hold = pool.probe(RequestKv(pool, "probe", longer, 0).page_hashes, len(longer))
        assert hold.num_blocks == len(PROMPT) // PAGE and hold.artifacts  # a real hit, with its checkpoint
        kv = RequestKv(wrong, "thief", longer, 4)
        assert kv.try_admit(hold.num_blocks)
        _refused(kv.match_and_add_prefix, hold)
        _refused(kv.adopt_handoff_prefix, hold, hold.num_tokens)
        _refused(wrong.trim_hold, hold, 0)
        _refused(wrong.check_hold, hold)
        res = wrong.reserve_loaded_blocks(1)
        assert res is not None
        _refused(wrong.commit_loaded_blocks, res, hold, [b"x" * 16])
        res.release()
        kv.release()
        assert not hold.consumed and hold.num_blocks == len(PROMPT) // PAGE  # nothing moved: the owner's, whole
        mine = RequestKv(pool, "mine", longer, 4)
        assert mine.try_admit(hold.num_blocks)
        for o in mine.match_and_add_prefix(hold):  # its own pool's request adopts it
            pool.fence(o)
        assert mine.num_computed == len(PROMPT)
        mine.release()
    elif kind == "reservation":
        res = pool.reserve_loaded_blocks(2)
        assert res is not None
        hold = wrong.probe([], 0)
        _refused(wrong.commit_loaded_blocks, res, hold, [b"x" * 16, b"y" * 16])
        hold.release()
        assert len(res.block_ids) == 2  # nothing moved: still its owner's, whole
        hold = pool.probe([], 0)
        pool.commit_loaded_blocks(res, hold, [])  # its owner still takes it (0 pages: released)
        hold.release()
    elif kind == "order":
        kv = _computed(owner, ri, "sealer")
        orders = kv.seal_by_copy()
        assert orders, "a bounded group at a page boundary gives a SEAL order"
        for o in orders:
            _refused(wrong.fence, o)
        _refused(other.execute_copies, rj, orders)
        for o in orders:  # the owner's pool fences them (as a failed copy: no worker in this test)
            pool.fence(o, ok=False)
        kv.release()
    elif kind == "cursor":
        first = _computed(owner, ri, "first")
        cursor = SealCursor()
        owner.seal(ri, first, cursor)  # binds the cursor to `first` (no tier: nothing is saved)
        second = _computed(other, rj, "second")
        _refused(other.seal, rj, second, cursor)
        _refused(other.retire, rj, second, cursor)
        assert not second.released  # the refused retire released nothing
        owner.retire(ri, first, cursor)  # its own request still retires with it
        other.retire(rj, second, SealCursor())
    else:  # a request sealed or retired on another rank or store than its pool's
        kv = _computed(owner, ri, "req")
        _refused(other.seal, rj, kv, SealCursor())
        _refused(other.retire, rj, kv, SealCursor())
        assert not kv.released
        owner.retire(ri, kv, SealCursor())

    assert _baseline(stores) == before  # nothing leaked, on any pool


def test_enum_and_scope_arguments_are_checked_by_type(stores: list[KvStore]) -> None:
    s = stores[0]
    kv = _computed(s, 0, "typed")
    with pytest.raises(TypeError, match="save_class"):
        s.retire(0, kv, SealCursor(), "handoff")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="save_class"):
        s.seal(0, kv, SealCursor(), "cacheable")  # type: ignore[arg-type]
    assert not kv.released
    s.retire(0, kv, SealCursor(), SaveClass.CACHEABLE)
    with pytest.raises(TypeError, match="scope"):
        s.resolve_prefix_sync(0, "r", PROMPT, "tenant-A")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="scope"):
        s.submit_resolve(0, "r", PROMPT, "tenant-A")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="policy"):
        s.resolve_prefix_sync(0, "r", PROMPT, DEFAULT_SCOPE, {"reuse": "full"})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="scope"):
        RequestKv(s.pools[0], "r", PROMPT, 1, scope="tenant-A")  # type: ignore[arg-type]


def test_an_envelope_is_refused_for_another_prompt_or_scope(stores: list[KvStore]) -> None:
    hasher = stores[0].pools[0].hasher
    committed = len(PROMPT) - 2  # a padded last page
    env = HandoffEnvelope("prod-1", "fp", committed_len=committed, anchor_token_id=7,
                          chain_key=chain_key(hasher, PROMPT, committed))
    check_envelope(env, "cons-1", hasher, PROMPT)  # its own prompt
    check_envelope(env, "cons-1", hasher, PROMPT + [5, 6])  # a longer request over the same committed tokens
    other = PROMPT[:-3] + [9, 9, 9]
    with pytest.raises(ForeignHandleError, match="prod-1"):
        check_envelope(env, "cons-2", hasher, other)
    with pytest.raises(ForeignHandleError):
        check_envelope(env, "cons-3", hasher, PROMPT, HashScope(cache_salt="tenant-B"))
    legacy = HandoffEnvelope("prod-0", "fp", committed_len=committed, anchor_token_id=7)
    check_envelope(legacy, "cons-4", hasher, other)  # no key (an older producer): not checked


def test_control_without_the_owner_check_a_foreign_hold_is_adopted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The property's control: with `BlockPool.check_handle` a no-op, rank 0's hold is adopted by rank 1's request,
    which then reports computed tokens over blocks of another pool (the silent wrong-KV path this check closes)."""
    from kvproc import BlockPool

    monkeypatch.setattr(BlockPool, "check_handle", lambda *a, **k: None)
    model = BytesModel(16)
    layout = validate_layout(model.spec(), model.arenas(0))
    a, b = (BlockPool.from_layout(layout, live_slots=1, rank=r) for r in range(2))
    seed = RequestKv(a, "seed", PROMPT, 0)
    assert seed.try_admit()
    seed.schedule(len(PROMPT))
    seed.apply()
    seed.release()
    longer = PROMPT + [1]
    hold = a.probe(RequestKv(a, "probe", longer, 0).page_hashes, len(longer))
    thief = RequestKv(b, "thief", longer, 4)
    assert thief.try_admit(hold.num_blocks)
    thief.match_and_add_prefix(hold)  # accepted: the check is what refuses it
    assert thief.num_computed == len(PROMPT)
