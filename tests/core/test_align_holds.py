"""Tensor parallel: `align_holds` trims one hold per rank to the prefix every rank can restore (issue 18)."""

from __future__ import annotations

from kvproc import RequestKv, align_holds
from tests.core.conftest import PAGE, bounded_pool, paged_pool, run_prompt

TOKENS = list(range(1, 4 * PAGE + 2))  # 4 full pages + 1 token: a hit of up to 4 pages


def _evict_from_page(pool, kv: RequestKv, page: int) -> None:  # type: ignore[no-untyped-def]
    """Drop one rank's cached pages from `page` on (as if its cache evicted more than the other rank's)."""
    with pool.lock:  # the test reaches in: a deterministic partial eviction of that rank's index
        pool.paged._unhash([pool.paged.index[h] for h in kv.page_hashes[page:] if h in pool.paged.index])


def test_holds_of_different_depths_are_trimmed_to_the_shortest_and_the_rest_goes_back() -> None:
    pools = [paged_pool(), paged_pool()]
    kvs = [run_prompt(p, f"r{r}", TOKENS) for r, p in enumerate(pools)]
    _evict_from_page(pools[1], kvs[1], 2)
    hashes = kvs[0].page_hashes
    holds = [p.probe(hashes, len(TOKENS)) for p in pools]
    assert [h.num_blocks for h in holds] == [4, 2]
    held_before = pools[0].stats()["active_blocks"]
    assert align_holds(holds) == 2
    assert [h.num_blocks for h in holds] == [2, 2] and holds[0].hashes == hashes[:2]
    assert pools[0].stats()["active_blocks"] == held_before - 2  # the trimmed blocks are no longer referenced
    assert pools[0].stats()["hold_trimmed_pages"] == 2
    for p, h in zip(pools, holds):
        p.check_hold(h)
        h.release()
    assert all(p.stats()["active_blocks"] == 0 for p in pools)


def test_a_bounded_hold_is_trimmed_to_a_complete_checkpoint_on_every_rank() -> None:
    """Rank 0 has checkpoints at pages 2 and 4, rank 1 only pages 0..3 cached: the common prefix is 3 pages, but a
    hold must end at a checkpoint, so both end at page 2 (the deepest one both have)."""
    pools = [bounded_pool(), bounded_pool()]
    kvs = []
    for r, pool in enumerate(pools):
        kv = RequestKv(pool, f"r{r}", TOKENS, 0)
        assert kv.try_admit(0)
        for _ in range(2):  # two chunks of 2 pages, a checkpoint (seal by copy) after each
            kv.schedule(2 * PAGE)
            kv.apply()
            for o in kv.seal_by_copy():
                pool.fence(o)
        kv.schedule(1)
        kv.apply()
        kv.release()
        kvs.append(kv)
    _evict_from_page(pools[1], kvs[1], 3)
    holds = [p.probe(kvs[0].page_hashes, len(TOKENS)) for p in pools]
    assert [h.num_blocks for h in holds] == [4, 2]  # rank 1: 3 pages match, its deepest checkpoint is at 2
    assert align_holds(holds) == 2
    assert [h.num_blocks for h in holds] == [2, 2]
    assert all(set(h.artifacts) == {"state"} for h in holds)  # each ends at its own checkpoint of page 2
    for h in holds:
        h.release()
    assert all(p.stats()["active_blocks"] == 0 for p in pools)
    assert all(p.slabs["state"].refcount.sum() == 0 for p in pools)  # every checkpoint reference went back


def test_equal_holds_are_left_as_they_are_and_no_holds_is_zero() -> None:
    pools = [paged_pool(), paged_pool()]
    kvs = [run_prompt(p, f"r{r}", TOKENS) for r, p in enumerate(pools)]
    holds = [p.probe(kvs[0].page_hashes, len(TOKENS)) for p in pools]
    assert align_holds(holds) == 4 and [h.num_blocks for h in holds] == [4, 4]
    for h in holds:
        h.release()
    assert align_holds([]) == 0
