"""Property: whatever mix of host hits, misses, device hits, tiny deadlines and cancellations (before or during the
call, from another thread) the blocking resolve path sees, across real processes, every resolve ends in exactly one
outcome, and once the abandoned loads settle nothing is left: no held or reserved block, no open lease."""

from __future__ import annotations

import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproc.ipc.cancel import new_token
from kvproc.store_types import ResolvePolicy, StoreConfig
from tests.test_cluster_fixtures import churn, cluster_store, compute, wait_for

pytestmark = pytest.mark.timeout(240)

SAVED = [list(range(100 * i, 100 * i + 17)) for i in range(4)]  # on the host tier (and maybe the device)
UNSAVED = [list(range(5000 + 100 * i, 5000 + 100 * i + 17)) for i in range(2)]  # misses everywhere

op = st.tuples(
    st.sampled_from(SAVED + UNSAVED),
    st.sampled_from([0.001, 0.004, 3.0]),  # resolve deadline: some expire mid-query or mid-load
    st.sampled_from([None, "before", 0.0, 0.001]),  # cancel: none, already cancelled, or from a timer
    st.booleans(),  # churn the device pool first (a host hit rather than a device hit)
)


@pytest.fixture(scope="module")
def cluster():  # type: ignore[no-untyped-def]
    with cluster_store(config=StoreConfig(resolve_deadline_s=3.0), num_blocks=64) as (cs, store, model):
        for i, toks in enumerate(SAVED):
            kv, cur, _, _ = compute(store, model, f"seed{i}", toks)
            store.retire(0, kv, cur)
        store.flush_saves(0, 10)
        yield cs, store, model


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(op, min_size=1, max_size=8))
def test_every_blocking_resolve_ends_once_and_leaves_nothing_behind(cluster, ops) -> None:  # type: ignore[no-untyped-def]
    cs, store, model = cluster
    before = sum(store.outcomes.counts[k] for k in store.outcomes.counts if k.startswith("resolve."))
    for i, (toks, deadline_s, cancel, do_churn) in enumerate(ops):
        if do_churn:
            churn(store)
        token = None
        if cancel is not None:
            token = new_token()
            if cancel == "before":
                token.cancel()
            else:
                threading.Timer(float(cancel), token.cancel).start()
        pre = store.resolve_prefix_sync(0, f"p{i}", toks, policy=ResolvePolicy(deadline_s=deadline_s), cancel=token)
        assert pre.hit_tokens in (0, 16) and pre.hold.num_blocks * 4 == pre.hit_tokens
        pre.hold.release()
    after = sum(store.outcomes.counts[k] for k in store.outcomes.counts if k.startswith("resolve."))
    assert after - before == len(ops)  # exactly one outcome per resolve
    store.flush_loads(0, 10)
    assert store.stats()["rank0"]["active_blocks"] == 0  # no hold, no reservation, no pin left
    wait_for(lambda: store.stats()["tier"]["open_leases"] == 0, timeout=10, what="every lease back")
    # no fault was injected: a load is never "failed" (a cancel stops the waiting, never the copy order itself)
    assert not [k for k in store.outcomes.counts if k.startswith("load.failed")], dict(store.outcomes.counts)
