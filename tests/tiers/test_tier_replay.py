"""Releases and aborts lost to a stalled shared tier are sent again once the engine is reconnected to it (found by
`kvproc bench chaos`: each SIGSTOP of the tier past its heartbeat liveness left leases to the 30 s lease TTL and
aborted saves open -- their slots taken and their pages "Loading" for other engines -- until the save TTL, minutes)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from kvproc import RequestKv
from kvproc.store.cluster import ClusterStore
from kvproc.store.types import SealCursor
from tests.conftest import kvproc_up, wait_for
from tests.store.conftest import SharedMemoryModel

pytestmark = pytest.mark.timeout(90)


def test_a_lease_released_while_the_shared_tier_stalled_is_released_once_it_answers_again() -> None:
    with kvproc_up("replayt") as (rd, tier_pid):
        with ClusterStore.start(1 << 20, tier_runtime_dir=rd) as cs:
            model = SharedMemoryModel(cs.allocator)
            store = cs.attach_model(model, live_slots=2)
            toks = list(range(1, 13))
            kv = RequestKv(store.pools[0], "a", toks, 4)
            assert kv.try_admit()
            kv.schedule(12)
            kv.apply()
            store.execute_copies(0, kv.seal_by_copy())
            store.retire(0, kv, SealCursor.after_prefix(0))
            store.flush_saves(0, 10)
            tier = store.tier
            assert tier is not None
            hit = store._loop.submit(tier.query("q", RequestKv(store.pools[0], "x", toks, 0).page_hashes,
                                                timeout=5)).result()
            assert hit.pages == 3 and store.stats()["tier"]["open_leases"] == 1
            os.kill(tier_pid, signal.SIGSTOP)
            try:
                wait_for(lambda: not tier.available, timeout=20, what="the stalled tier declared dead")
                tier.release_lease(hit.lease_id)  # lost to the dead client: kept for later
            finally:
                os.kill(tier_pid, signal.SIGCONT)
            wait_for(lambda: tier.available, timeout=20, what="reconnected to the tier")
            t0 = time.monotonic()
            wait_for(lambda: store.stats()["tier"]["open_leases"] == 0, timeout=10, what="the lease released")
            assert time.monotonic() - t0 < 10  # far below the 30 s lease TTL: the release, not the reaper
            assert tier.counters["oneway_deferred_ReleaseLease"] == 1 and tier.counters["oneway_replayed"] >= 1
            assert store.stats()["tier"].get("leases_reclaimed_by_ttl", 0) == 0
