"""Property: whatever mix of host hits, misses, device hits, tiny deadlines, cancellations (before or during the
call, from another thread) and wrong slot-cache hints (speculative loads) the blocking resolve path sees, across real
processes, every resolve ends in exactly one outcome, every block it returns holds the bytes saved under its hash,
and once the abandoned loads settle nothing is left: no held or reserved block, no open lease."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproc.ipc.cancel import new_token
from kvproc.store.types import ResolvePolicy, StoreConfig
from tests.conftest import churn, cluster_store, compute, wait_for

pytestmark = pytest.mark.timeout(240)

SAVED = [list(range(100 * i, 100 * i + 17)) for i in range(4)]  # on the host tier (and maybe the device)
UNSAVED = [list(range(5000 + 100 * i, 5000 + 100 * i + 17)) for i in range(2)]  # misses everywhere

op = st.tuples(
    st.sampled_from(SAVED + UNSAVED),
    st.sampled_from([0.001, 0.004, 3.0]),  # resolve deadline: some expire mid-query or mid-load
    st.sampled_from([None, "before", 0.0, 0.001]),  # cancel: none, already cancelled, or from a timer
    st.booleans(),  # churn the device pool first (a host hit rather than a device hit)
    st.sampled_from([None, "other_slots", "old_generation", "forget_tail"]),  # lie to the slot cache first
)


@pytest.fixture(scope="module")
def cluster():  # type: ignore[no-untyped-def]
    with cluster_store(config=StoreConfig(resolve_deadline_s=3.0), num_blocks=64) as (cs, store, model):
        written: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        for i, toks in enumerate(SAVED):
            kv, cur, _, w = compute(store, model, f"seed{i}", toks)
            written.update(w)
            store.retire(0, kv, cur)
        store.flush_saves(0, 10)
        yield cs, store, model, written


def _lie(store, toks: list[int], how: str) -> None:  # type: ignore[no-untyped-def]
    """Make the slot cache wrong about `toks`'s pages (if it knows them): the speculative load must not believe it."""
    keys = store.pools[0].hasher.hash_prompt(toks)
    cache = store.slot_caches[0]
    slots, gens = cache.run(keys)
    if not slots:
        return
    if how == "other_slots":
        cache.learn(keys, [s + 1 for s in slots], gens)
    elif how == "old_generation":
        cache.learn(keys, slots, [g - 1 for g in gens])
    else:
        cache.forget(keys[2:])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=1, max_size=8))
def test_every_blocking_resolve_ends_once_and_leaves_nothing_behind(cluster, ops) -> None:  # type: ignore[no-untyped-def]
    cs, store, model, written = cluster
    before = sum(store.outcomes.counts[k] for k in store.outcomes.counts if k.startswith("resolve."))
    for i, (toks, deadline_s, cancel, do_churn, lie) in enumerate(ops):
        if do_churn:
            churn(store)
        if lie is not None:
            _lie(store, toks, lie)
        token = None
        if cancel is not None:
            token = new_token()
            if cancel == "before":
                token.cancel()
            else:
                threading.Timer(float(cancel), token.cancel).start()
        pre = store.resolve_prefix_sync(0, f"p{i}", toks, policy=ResolvePolicy(deadline_s=deadline_s), cancel=token)
        # a speculative load may keep its confirmed pages when the rest of the hit is cut short
        assert pre.hit_tokens in (0, 4, 8, 12, 16) and pre.hold.num_blocks * 4 == pre.hit_tokens
        for h, b in zip(pre.hold.hashes, pre.hold.block_ids):
            assert torch.equal(model.block(0, b), written[h][0]) and torch.equal(model.block(1, b), written[h][1])
        pre.hold.release()
    after = sum(store.outcomes.counts[k] for k in store.outcomes.counts if k.startswith("resolve."))
    assert after - before == len(ops)  # exactly one outcome per resolve
    store.flush_loads(0, 10)
    assert store.stats()["rank0"]["active_blocks"] == 0  # no hold, no reservation, no pin left
    wait_for(lambda: store.stats()["tier"]["open_leases"] == 0, timeout=10, what="every lease back")
    # no fault was injected: a load is never "failed" (a cancel stops the waiting, never the copy order itself)
    assert not [k for k in store.outcomes.counts if k.startswith("load.failed")], dict(store.outcomes.counts)
