"""KV events (issue 21): a subscriber rebuilds the host tier's key set from the event stream alone, after a workload
that makes the tier evict, and it matches what the tier answers; no batch is lost or out of order (seq), the replay
gives the same batches as the live stream, and the events have vLLM's KVEventBatch shape."""

from __future__ import annotations

from typing import Any

import zmq

from kvproc.ipc import messages as m
from kvproc.tiers.kv_events import (
    TOPIC,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    endpoints,
)
from tests.conftest import cluster_store, compute, replay_kv_events, wait_for


def _rebuild(batches: list[KVEventBatch]) -> tuple[set[bytes], int, int]:
    keys: set[bytes] = set()
    stored = removed = 0
    for batch in batches:
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):
                keys.clear()
            elif isinstance(e, BlockStored):
                assert not keys & set(e.block_hashes), "a page stored twice without a removal between"
                keys.update(e.block_hashes)
                stored += len(e.block_hashes)
                assert e.block_size == 4 and e.medium == "cpu" and e.token_ids == []
            elif isinstance(e, BlockRemoved):
                assert set(e.block_hashes) <= keys, "a page removed that was never stored"
                keys.difference_update(e.block_hashes)
                removed += len(e.block_hashes)
    return keys, stored, removed


def _tier_has(client: Any, key: bytes) -> bool:
    reply = client.request(m.Query("probe", [key]), timeout=5)
    if isinstance(reply, m.TierHit):
        client.request(m.ReleaseLease(reply.lease_id), timeout=5)
        return reply.pages == 1
    return False


def test_a_subscriber_rebuilds_the_tiers_key_set_from_events_alone() -> None:
    with cluster_store(64 << 10, kv_events=True) as (cs, store, model):  # ~60 page slots: the workload evicts
        pub, replay = endpoints(cs.cluster.runtime_dir, 0)
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.connect(pub)
        try:
            universe: list[bytes] = []
            for i in range(40):  # 40 prompts of 4 pages each: 160 distinct pages through ~60 slots
                toks = [1000 * i + j for j in range(17)]
                kv, cur, _, _ = compute(store, model, f"r{i}", toks)
                universe += kv.page_hashes[:4]
                store.retire(0, kv, cur)
                store.flush_saves(0, 10)
            tier = cs.cluster.client("host_tier")
            counters = tier.request(m.Stats(), timeout=5).counters
            assert counters["index.evictions"] > 0  # the workload really churned the tier
            def all_sent() -> bool:  # every event the tier published went out (batches wait up to an interval)
                c = tier.request(m.Stats(), timeout=5).counters
                return bool(c["kv_events.events"] == c["kv_events.queued"] and
                            c["kv_events.seq"] == len(replay_kv_events(replay)))

            wait_for(all_sent, what="every batch published")
            kept = replay_kv_events(replay)
            seqs = [s for s, _ in kept]
            assert seqs == list(range(len(seqs))), "a gap or a reordering in the batches' seq"
            batches = [decode_batch(p) for _, p in kept]
            assert isinstance(batches[0].events[0], AllBlocksCleared)
            keys, stored, removed = _rebuild(batches)
            assert removed > 0 and stored - removed == len(keys)
            assert len(keys) == tier.request(m.TierStats(), timeout=5).counters["entries"]
            assert keys <= set(universe)
            for key in universe:  # the rebuilt set is exactly what the tier answers for every page ever saved
                assert _tier_has(tier, key) == (key in keys)
            # the live stream carried the same batches (those it got after connecting: the PUB drops earlier ones)
            live: list[tuple[int, bytes]] = []
            while sub.poll(100):
                topic, seq, payload = sub.recv_multipart()
                assert topic == TOPIC
                live.append((int.from_bytes(seq, "big", signed=True), payload))
            assert live and live == kept[len(kept) - len(live):]
        finally:
            sub.close()


def test_a_tier_without_kv_events_publishes_nothing() -> None:
    with cluster_store() as (cs, store, model):
        counters = cs.cluster.client("host_tier").request(m.Stats(), timeout=5).counters
        assert not any(k.startswith("kv_events.") for k in counters)


def test_the_manifest_names_the_events_and_metrics_endpoints_and_they_answer() -> None:
    from kvproc.runtime import manifest as mf

    with cluster_store(kv_events=True, metrics="127.0.0.1:0") as (cs, _, _):
        found = mf.read_manifest(cs.cluster.runtime_dir)  # what a console or a router reads: nothing else shared
        assert found.metrics == cs.cluster.metrics.address
        (tier,) = [p for p in found.processes if p.role == "host_tier"]
        assert tier.published == {**dict(zip(("kv_events", "kv_events_replay"), endpoints(cs.cluster.runtime_dir, 0))),
                                  "kv_events_interval_ms": "50"}
        (worker,) = [p for p in found.processes if p.role == "copy_worker"]
        assert worker.published == {}
        replay = tier.published["kv_events_replay"]
        wait_for(lambda: bool(replay_kv_events(replay)), timeout=10, what="the first batch (sent within an interval)")
        first = replay_kv_events(replay)[0]
        assert first[0] == 0 and isinstance(decode_batch(first[1]).events[0], AllBlocksCleared)
    with cluster_store() as (cs, _, _):
        found = mf.read_manifest(cs.cluster.runtime_dir)
        assert found.metrics == "" and all(p.published == {} for p in found.processes)
