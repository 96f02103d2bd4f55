"""P/D hand-offs across two "nodes" (two clusters, separate host tiers) sharing one real Mooncake Store on loopback:
a decode node's full-hit wait is answered once the producer's write-through lands in Mooncake (the consumer asked
first); a revoked hand-off is removed from Mooncake, a consumed one stays there as cache; a hand-off that commits
while Mooncake is down is answered within its deadline, counted, and the producer keeps serving."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvproc.store.handoff import handoff_resolve_policy
from kvproc.store.kv_store import KvStore
from kvproc.store.types import SaveClass
from kvproc.tiers.mooncake_local import LocalMooncake, unavailable_reason
from tests.conftest import (
    MooncakeNamespace,
    ShmBytesModel,
    Written,
    check_bytes,
    cluster_store,
    compute,
    nothing_left,
    remote_stats,
    restores,
    wait_for,
)

pytestmark = pytest.mark.timeout(120)

TOKS = list(range(1, 18))  # 4 full pages of 4 tokens: the hand-off's chain is the first 16
WAIT_S = 8.0  # the consumer's full-hit deadline (generous: the write-through takes milliseconds)


def produce(store: KvStore, model: ShmBytesModel, rid: str, toks: list[int]) -> Written:
    """Prefill side: compute and retire with Handoff; returns the page bytes."""
    kv, cur, _, written = compute(store, model, rid, toks)
    store.retire(0, kv, cur, SaveClass.HANDOFF)
    store.flush_saves(0, 10)
    return written


def connected(*stores: KvStore) -> None:
    for s in stores:
        wait_for(lambda s=s: remote_stats(s).get("connected") == 1, 10, "connected to Mooncake")


def consume(store: KvStore, producer: str, toks: list[int], wait_s: float = WAIT_S) -> Any:
    """A decode node's full-hit resolve of the producer's chain (the first 16 tokens)."""
    return store.resolve_prefix_sync(0, f"dec-{producer}", toks[:16], policy=handoff_resolve_policy(producer, wait_s))


class Consumer(threading.Thread):
    """A decode node's full-hit resolve of a producer's chain, on its own thread (it waits)."""

    def __init__(self, store: KvStore, producer: str, toks: list[int], wait_s: float = WAIT_S) -> None:
        super().__init__(daemon=True)
        self.store, self.producer, self.toks, self.wait_s = store, producer, toks, wait_s
        self.prefix: Any = None

    def run(self) -> None:
        self.prefix = consume(self.store, self.producer, self.toks, self.wait_s)

    def result(self) -> Any:
        self.join(self.wait_s + 10)
        assert not self.is_alive(), "the consumer's resolve hung past its deadline"
        return self.prefix


def test_a_consumer_that_asks_first_is_served_once_the_producer_writes_through(mooncake: MooncakeNamespace) -> None:
    """No KV-ready barrier: node B's full-hit resolve is parked before node A has even computed the prompt. B's host
    tier re-probes Mooncake for the awaited key, answers the wait when A's write-through lands, and the resolve pulls
    the pages through B's own host tier: the producer's bytes, the hand-off consumed, nothing left on either node."""
    with cluster_store(remote=mooncake.url) as (_, a, model_a), cluster_store(remote=mooncake.url) as (_, b, model_b):
        connected(a, b)
        model_b.zero()
        consumer = Consumer(b, "prod", TOKS)
        consumer.start()
        wait_for(lambda: b.stats()["tier"]["waiters"] == 1, 10, "B's full-hit wait parked")
        written = produce(a, model_a, "prod", TOKS)
        prefix = consumer.result()
        assert prefix.host_tokens == 16, remote_stats(b)  # 0 when the wait ran out its deadline
        check_bytes(model_b, prefix, written)
        prefix.hold.release()
        rb = remote_stats(b)
        assert rb["watch_found"] >= 1 and rb["watch_probes"] >= 1 and rb["pulled_pages"] == 4, rb
        assert remote_stats(a)["handoffs_written_through"] >= 1
        nothing_left(b)
        for s in (a, b):
            tier = s.stats()["tier"]
            assert tier["open_handoffs"] == 0 and tier["open_leases"] == 0 and tier["waiters"] == 0, tier


def test_a_full_hit_wait_for_a_handoff_nobody_produces_ends_at_its_deadline(mooncake: MooncakeNamespace) -> None:
    """The watch is bounded by the wait's deadline: the resolve misses, the key is dropped (counted), no waiter
    or lease is left."""
    with cluster_store(remote=mooncake.url) as (_, b, _):
        connected(b)
        consumer = Consumer(b, "nobody", TOKS, wait_s=1.5)
        consumer.start()
        assert consumer.result().host_tokens == 0
        consumer.prefix.hold.release()
        wait_for(lambda: remote_stats(b).get("watch_expired", 0) + remote_stats(b).get("watch_abandoned", 0) == 1,
                 10, "the watched key dropped")
        rb = remote_stats(b)
        assert rb.get("watch_found", 0) == 0 and rb["watch_probes"] >= 1
        nothing_left(b)
        assert b.stats()["tier"]["waiters"] == 0


@pytest.fixture()
def short_lease() -> Iterator[LocalMooncake]:
    """A Mooncake Store whose read leases last 1 s (the master's `--default_kv_lease_ttl`; 10 s by default)."""
    why = unavailable_reason()
    if why:
        pytest.skip(why)
    with LocalMooncake.start(segment_mb=64, lease_ttl_ms=1000) as mc:
        yield mc


def test_a_revoked_handoff_leaves_mooncake_and_a_consumed_one_stays_as_cache(short_lease: LocalMooncake) -> None:
    """Three nodes. A hand-off consumed on B stays in Mooncake (soft-pinned until the hand-off TTL) and C, which never
    saw it, restores it as plain cache. A hand-off its producer revokes before anyone read it is removed from Mooncake
    (the keys its write-through created): B's full-hit resolve of it misses."""
    url = short_lease.url + "&lease_ttl=1"
    with cluster_store(remote=url) as (_, a, model_a), cluster_store(remote=url) as (_, b, model_b), \
            cluster_store(remote=url) as (_, c, model_c):
        connected(a, b, c)
        kept = produce(a, model_a, "kept", TOKS)
        wait_for(lambda: remote_stats(a).get("handoffs_written_through", 0) == 1, 10, "written through")
        ra = remote_stats(a)
        assert ra["handoff_keys_pinned"] == 4 and ra["handoffs_pinned"] == 1, ra
        model_b.zero()
        prefix = consume(b, "kept", TOKS)
        assert prefix.host_tokens == 16
        check_bytes(model_b, prefix, kept)
        prefix.hold.release()
        assert restores(c, model_c, "c-kept", TOKS, kept) == 4  # plain cache on a third node
        assert remote_stats(c)["pulled_pages"] == 4

        other = list(range(100, 117))
        gone = produce(a, model_a, "gone", other)
        wait_for(lambda: remote_stats(a).get("handoffs_written_through", 0) == 2, 10, "written through")
        # C reads the pages first (a plain prefix hit: they are cache on C from now on): Mooncake leases them for a
        # second, so the revoke's first removal is refused and retried once the lease is over.
        assert restores(c, model_c, "c-gone", other, gone) == 4
        a.revoke_handoff("gone")  # the producer's revoke: nobody will read it
        wait_for(lambda: remote_stats(a).get("handoff_keys_removed", 0) == 4, 10, "the revoked keys removed")
        assert remote_stats(a)["handoff_remove_retried"] >= 1
        missed = consume(b, "gone", other, wait_s=1.5)
        assert missed.host_tokens == 0, remote_stats(b)
        missed.hold.release()
        ra = remote_stats(a)
        assert ra["handoffs_pinned"] == 1 and ra.get("handoff_remove_failed", 0) == 0  # "kept" is still pinned
        assert ra.get("handoff_keys_removed", 0) == 4  # "kept"'s keys were never removed
        for s in (a, b, c):
            nothing_left(s)
            tier = s.stats()["tier"]
            assert tier["open_handoffs"] == 0 and tier["waiters"] == 0, tier
