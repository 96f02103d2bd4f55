"""Issue 15 item 14, small API gaps, each refused loudly instead of misread: a rank the store does not have (5 on a
one-rank store: "tuple index out of range"; -1: silently the last rank), `ResolvePolicy(deadline_s=0)` (silently the
default), two arenas over the same memory (accepted), and the launch timeout message (it printed the time left,
"within 0.0s", not the limit)."""

from __future__ import annotations

import asyncio
import math
import os
import time
from typing import Any, Callable, Iterator

import pytest
import torch

from kvproc import GroupKind, GroupSpec, KvArena, KvContractError, KvSpec, RequestKv, validate_layout
from kvproc.runtime import ClusterStartError, RoleConfig, launch
from kvproc.runtime.role import Role, RoleEnv
from kvproc.store.kv_store import KvStore
from kvproc.store.types import ResolvePolicy, SealCursor, StoreConfig
from tests.store.conftest import make_store

# -- ranks ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def store() -> Iterator[KvStore]:
    s, _, tier, copier = make_store(bounded=True)
    try:
        yield s
    finally:
        s.close()
        assert copier is not None and tier is not None
        copier.close()
        tier.close()


def _verbs(store: KvStore) -> dict[str, Callable[[int], Any]]:
    kv = RequestKv(store.pools[0], "r", list(range(8)), 2)
    cur = SealCursor()
    return {
        "resolve_prefix": lambda r: asyncio.run(store.resolve_prefix(r, "r", list(range(8)))),
        "submit_resolve": lambda r: store.submit_resolve(r, "r", list(range(8))).result(5),
        "resolve_prefix_sync": lambda r: store.resolve_prefix_sync(r, "r", list(range(8))),
        "seal": lambda r: store.seal(r, kv, cur),
        "retire": lambda r: store.retire(r, kv, cur),
        "execute_copies": lambda r: store.execute_copies(r, []),
        "flush_saves": lambda r: store.flush_saves(r, 5),
        "flush_loads": lambda r: store.flush_loads(r, 5),
        "pinned_blocks": lambda r: store.pinned_blocks(r),
        "parked": lambda r: store.parked(r),
    }


VERBS = ["resolve_prefix", "submit_resolve", "resolve_prefix_sync", "seal", "retire", "execute_copies", "flush_saves",
         "flush_loads", "pinned_blocks", "parked"]


@pytest.mark.parametrize("rank", [5, 1, -1, True, "0"])
@pytest.mark.parametrize("verb", VERBS)
def test_a_rank_the_store_does_not_have_is_refused_naming_the_valid_range(store: KvStore, verb: str,
                                                                          rank: Any) -> None:
    call = _verbs(store)[verb]
    with pytest.raises(ValueError, match=r"rank .* outside this store's ranks \[0, 1\)"):
        call(rank)
    assert store.stats()["rank0"]["active_blocks"] == 0  # refused before anything was taken


def test_rank_zero_still_works(store: KvStore) -> None:
    pre = store.resolve_prefix_sync(0, "ok", list(range(8)))
    pre.hold.release()
    assert store.execute_copies(0, []) is True
    store.flush_saves(0, 5)
    store.flush_loads(0, 5)


# -- resolve deadline ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [0, 0.0, -1.0, math.nan, math.inf, -math.inf, True])
def test_a_deadline_that_is_not_a_positive_finite_number_is_refused(bad: Any) -> None:
    with pytest.raises(ValueError, match="deadline_s"):
        ResolvePolicy(deadline_s=bad)


def test_none_means_the_default_and_a_positive_deadline_is_kept() -> None:
    assert ResolvePolicy().deadline_s is None
    assert ResolvePolicy(deadline_s=0.25).deadline_s == 0.25
    assert ResolvePolicy(deadline_s=3).deadline_s == 3


def test_a_short_deadline_is_honoured_and_none_takes_the_stores() -> None:
    store, _, tier, copier = make_store(config=StoreConfig(resolve_deadline_s=0.6))
    assert tier is not None and copier is not None
    try:
        tier.query_gate.ev.clear()  # the tier never answers
        for policy, lo, hi in ((ResolvePolicy(deadline_s=0.05), 0.0, 0.4), (ResolvePolicy(), 0.5, 3.0)):
            t0 = time.monotonic()
            pre = store.resolve_prefix_sync(0, "d", list(range(8)), policy=policy)
            took = time.monotonic() - t0
            pre.hold.release()
            assert lo <= took < hi, (policy, took)
        tier.query_gate.ev.set()
    finally:
        store.close()
        copier.close()
        tier.close()


# -- overlapping arenas --------------------------------------------------------------------------------------------

SPEC = KvSpec(16, (GroupSpec("kv", GroupKind.PAGED), GroupSpec("state", GroupKind.BOUNDED)))


def _arena(name: str, t: torch.Tensor, blocks: int = 4, bpb: int = 64, stride: int = 64) -> KvArena:
    return KvArena(name, t, blocks, bpb, stride)


def test_two_arenas_over_the_same_tensor_are_refused_naming_both() -> None:
    buf = torch.zeros(256, dtype=torch.uint8)
    with pytest.raises(KvContractError, match=r"arena '(k1|k0)'.*overlaps arena '(k0|k1)'"):
        validate_layout(SPEC, [("kv", _arena("k0", buf)), ("kv", _arena("k1", buf)),
                               ("state", _arena("s0", torch.zeros(256, dtype=torch.uint8)))])


def test_arenas_of_different_groups_that_overlap_partly_are_refused() -> None:
    buf = torch.zeros(1024, dtype=torch.uint8)
    with pytest.raises(KvContractError, match=r"'s0' \(group 'state'\) overlaps arena 'k0' \(group 'kv'\)"):
        validate_layout(SPEC, [("kv", _arena("k0", buf[:256])), ("state", _arena("s0", buf[255:511]))])


def test_the_extent_is_the_last_blocks_end_not_the_tensor_size() -> None:
    buf = torch.zeros(2048, dtype=torch.uint8)
    # 4 blocks of 64 bytes, 100 apart: [0, 364). A neighbour at 364 is disjoint, one at 363 is not.
    validate_layout(SPEC, [("kv", _arena("k0", buf[:364], stride=100)), ("state", _arena("s0", buf[364:620]))])
    with pytest.raises(KvContractError, match="overlaps"):
        validate_layout(SPEC, [("kv", _arena("k0", buf[:364], stride=100)), ("state", _arena("s0", buf[363:619]))])


def test_an_arena_nested_inside_a_long_one_is_found_past_a_short_one_between() -> None:
    """The sweep compares with the furthest end so far, not only the previous arena."""
    buf = torch.zeros(4096, dtype=torch.uint8)
    long_ = _arena("long", buf, blocks=16, bpb=256, stride=256)  # [0, 4096)
    inner1 = _arena("i1", buf[512:768])
    inner2 = _arena("i2", buf[1024:1280])
    with pytest.raises(KvContractError, match="overlaps arena 'long'"):
        validate_layout(SPEC, [("kv", inner1), ("kv", inner2), ("kv", long_),
                               ("state", _arena("s0", torch.zeros(256, dtype=torch.uint8)))])


def test_disjoint_views_of_one_buffer_are_accepted() -> None:
    buf = torch.zeros(1024, dtype=torch.uint8)
    lay = validate_layout(SPEC, [("kv", _arena("k0", buf[:256])), ("kv", _arena("k1", buf[256:512])),
                                 ("state", _arena("s0", buf[512:768])), ("state", _arena("s1", buf[768:]))])
    assert lay.num_paged_blocks == 4


def test_many_arenas_are_checked_quickly() -> None:
    arenas = [("kv", _arena(f"k{i}", torch.zeros(256, dtype=torch.uint8))) for i in range(2000)]
    t0 = time.perf_counter()
    validate_layout(SPEC, arenas + [("state", _arena("s0", torch.zeros(256, dtype=torch.uint8)))])
    assert time.perf_counter() - t0 < 2.0


# -- launch timeout message ----------------------------------------------------------------------------------------


class SlowStartRole(Role):
    """Test role that never reports ready in time (it sleeps in its constructor)."""

    name = "slow_start"

    def __init__(self, env: RoleEnv) -> None:
        super().__init__(env)
        time.sleep(30)


@pytest.mark.timeout(60)
def test_the_launch_timeout_message_names_the_limit_not_the_time_left() -> None:
    slow = RoleConfig("slow", 0, role_class=f"{__name__}:SlowStartRole")
    with pytest.raises(ClusterStartError, match=r"slow\[0\] pid \d+ did not come up within 0\.5s"):
        launch([slow], cluster_name="ag", runtime_dir=f"/tmp/kvag-{os.getpid()}", ready_timeout_s=0.5)
    assert not os.path.exists(f"/tmp/kvag-{os.getpid()}")
