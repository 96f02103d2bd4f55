"""Small builders shared by the pool tests."""

from __future__ import annotations

from kvproc import BlockPool, GroupKind, GroupSpec, KvSpec, RequestKv

PAGE = 4


def paged_spec(page: int = PAGE) -> KvSpec:
    return KvSpec(page, (GroupSpec("kv", GroupKind.PAGED),))


def bounded_spec(*, optional_extra: bool = False, page: int = PAGE) -> KvSpec:
    groups = [GroupSpec("kv", GroupKind.PAGED), GroupSpec("state", GroupKind.BOUNDED)]
    if optional_extra:
        groups.append(GroupSpec("extra", GroupKind.BOUNDED, optional=True))
    return KvSpec(page, tuple(groups))


def paged_pool(num_blocks: int = 16) -> BlockPool:
    return BlockPool(paged_spec(), num_blocks)


def bounded_pool(num_blocks: int = 32, *, optional_extra: bool = False, slots: int = 6, live: int = 2) -> BlockPool:
    spec = bounded_spec(optional_extra=optional_extra)
    return BlockPool(spec, num_blocks, bounded_slots={g.name: slots for g in spec.bounded_groups}, live_slots=live)


def run_prompt(pool: BlockPool, req_id: str, tokens: list[int], max_out: int = 0, *, release: bool = True) -> RequestKv:
    """Admit, match the prefix, compute the rest in one step, optionally release: the sealed pages stay matchable."""
    kv = RequestKv(pool, req_id, tokens, max_out)
    hold = pool.probe(kv.page_hashes, kv.num_tokens)
    assert kv.try_admit(hold.num_blocks), f"{req_id} not admitted"
    orders = kv.match_and_add_prefix(hold)
    for o in orders:
        pool.fence(o)
    rest = kv.num_tokens - kv.num_computed
    if rest:
        kv.schedule(rest)
        kv.apply()
    if release:
        kv.release()
    return kv
