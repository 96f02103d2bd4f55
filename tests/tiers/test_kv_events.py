"""KV events (issue 21): a subscriber rebuilds the host tier's key set from the event stream alone, after a workload
that makes the tier evict, and it matches what the tier answers; no batch is lost or out of order (seq), the replay
gives the same batches as the live stream, and the events have vLLM's KVEventBatch shape."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
import zmq

from kvproc.ipc import messages as m
from kvproc.runtime import manifest as mf
from kvproc.store.cluster import ClusterStore
from kvproc.store.types import SealCursor
from kvproc.tiers.kv_events import (
    TOPIC,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    endpoints,
)
from tests.conftest import admit, cluster_store, compute, kvproc_up, replay_kv_events, wait_for


def _rebuild(batches: list[KVEventBatch], parents: dict[bytes, bytes | None],
             page_tokens: dict[bytes, list[int]] | None = None) -> tuple[set[bytes], int, int]:
    """The key set the events describe, and the pages stored and removed. `parents` (page hash -> the prompt's page
    before it, None at the prompt's first): each BlockStored's parent must be its first page's. `page_tokens` (page
    hash -> its tokens): each BlockStored's token ids must be its pages' tokens one page after the other; None: they
    must be empty."""
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
                assert e.block_size == 4 and e.medium == "CPU"
                # a router places the run under its parent: the prompt's page before it, wherever the save started
                assert e.parent_block_hash == parents[e.block_hashes[0]]
                if page_tokens is None:
                    assert e.token_ids == []
                else:
                    assert e.token_ids == [t for h in e.block_hashes for t in page_tokens[h]]
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


@pytest.mark.parametrize("tokens", [False, True], ids=["hashes", "with_token_ids"])
def test_a_subscriber_rebuilds_the_tiers_key_set_from_events_alone(tokens: bool) -> None:
    # ~60 page slots: the workload evicts. `kv_events_tokens`: each BlockStored carries its pages' token ids (the
    # prompt's page slices), else none (the save path carries no tokens then). Every other prompt is the one before's
    # next turn (its 4 pages, then 2 new ones): its save starts at page 4 after a prefix hit (device or host), so its
    # first run's parent is a page before the save, which only the store knows (`SaveEvents.parent_key`).
    with cluster_store(64 << 10, kv_events=True, kv_events_tokens=tokens) as (cs, store, model):
        pub, replay = endpoints(cs.cluster.runtime_dir, 0)
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.connect(pub)
        try:
            tier0 = store.tier_of(0)
            assert tier0 is not None and tier0.wants_token_ids is tokens and tier0.wants_parent_key
            universe: list[bytes] = []
            page_tokens: dict[bytes, list[int]] = {}
            parents: dict[bytes, bytes | None] = {}
            mid_prompt = 0
            toks: list[int] = []
            for i in range(40):  # 20 prompts of 4 pages, 20 next turns of 2 more: 120 distinct pages, ~60 slots
                first_turn = [1000 * i + j for j in range(17)]
                toks = first_turn if i % 2 == 0 else toks[:16] + first_turn[:9]
                kv, cur, _, _ = compute(store, model, f"r{i}", toks)
                n = len(toks) // 4
                mid_prompt += cur.pages > 0
                universe += kv.page_hashes[:n]
                page_tokens.update((h, toks[k * 4:(k + 1) * 4]) for k, h in enumerate(kv.page_hashes[:n]))
                parents.update((h, kv.page_hashes[k - 1] if k else None) for k, h in enumerate(kv.page_hashes[:n]))
                store.retire(0, kv, cur)
                store.flush_saves(0, 10)
            assert mid_prompt >= 10  # next turns hit their first turn's pages: their saves start mid-prompt
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
            keys, stored, removed = _rebuild(batches, parents, page_tokens if tokens else None)
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
        tier = store.tier_of(0)
        assert tier is not None and not tier.wants_parent_key and not tier.wants_token_ids  # the saves carry nothing


def test_the_manifest_names_the_events_and_metrics_endpoints_and_they_answer() -> None:
    from kvproc.runtime import manifest as mf

    with cluster_store(kv_events=True, metrics="127.0.0.1:0") as (cs, _, _):
        found = mf.read_manifest(cs.cluster.runtime_dir)  # what a console or a router reads: nothing else shared
        assert found.metrics == cs.cluster.metrics.address
        (tier,) = [p for p in found.processes if p.role == "host_tier"]
        assert tier.published == {**dict(zip(("kv_events", "kv_events_replay"), endpoints(cs.cluster.runtime_dir, 0))),
                                  "kv_events_interval_ms": "50", "kv_events_tokens": "0"}
        (worker,) = [p for p in found.processes if p.role == "copy_worker"]
        assert worker.published == {}
        replay = tier.published["kv_events_replay"]
        wait_for(lambda: bool(replay_kv_events(replay)), timeout=10, what="the first batch (sent within an interval)")
        first = replay_kv_events(replay)[0]
        assert first[0] == 0 and isinstance(decode_batch(first[1]).events[0], AllBlocksCleared)
    with cluster_store() as (cs, _, _):
        found = mf.read_manifest(cs.cluster.runtime_dir)
        assert found.metrics == "" and all(p.published == {} for p in found.processes)


def test_a_kvproc_up_tier_with_token_ids_gets_them_from_every_engine_that_attaches() -> None:
    """Token ids per run of new pages, where a save does not start at the prompt's first page (a device hit before
    it) and where its first pages were in the tier already (saved by a request computed side by side)."""
    with kvproc_up("kvtok", "--kv-events", "--kv-events-tokens") as (rd, _pid):
        (tier,) = [p for p in mf.read_manifest(rd).processes if p.role == "host_tier"]
        with cluster_store(1 << 20, tier_runtime_dir=rd) as (cs, store, model):
            assert store.tier_of(0).wants_token_ids  # type: ignore[union-attr]  # told by the tier's Configured
            t1 = list(range(500, 517))  # pages A B C D (+1 token)
            kv1, cur, _, _ = compute(store, model, "t1", t1)
            store.retire(0, kv1, cur)
            store.flush_saves(0, 10)  # each save commits before the next: the events' order is then the test's
            t2 = t1[:16] + list(range(600, 609))  # A B C D (a device hit) then E F: its save starts at page 4
            kv2, cur, prefix, _ = compute(store, model, "t2", t2)
            assert prefix.device_tokens == 16 and cur.pages == 4
            store.retire(0, kv2, cur)
            store.flush_saves(0, 10)
            # G H computed by two requests side by side: "short" (G H) saves first, "long" (G H I J) then saves
            # from page 0 and finds G H in the tier: its new run is I J, the save's pages 2-3
            t3 = list(range(700, 717))
            kvs = []
            for rid, toks in (("short", t3[:9]), ("long", t3)):
                kvx, _ = admit(store, rid, toks, hit_blocks=0)
                kvs.append(kvx)
            for kvx in kvs:
                kvx.apply()
            for kvx in kvs:
                store.retire(0, kvx, SealCursor.after_prefix(0))
                store.flush_saves(0, 10)
            client = cs._tier_client(0)
            wait_for(lambda: (c := client.request(m.Stats(), timeout=5).counters)["kv_events.events"]
                     == c["kv_events.queued"] >= 5, timeout=30, what="the saves' batches")
            stored = [e for _, p in replay_kv_events(tier.published["kv_events_replay"])
                      for e in decode_batch(p).events if isinstance(e, BlockStored)]
            long = kvs[1].page_hashes
            assert [(e.block_hashes, e.parent_block_hash, e.token_ids) for e in stored] == [
                (kv1.page_hashes[:4], None, t1[:16]),
                (kv2.page_hashes[4:6], kv2.page_hashes[3], t2[16:24]),  # the page before the save: from the store
                (long[:2], None, t3[:8]),  # the prompt's first page: no parent
                (long[2:4], long[1], t3[8:16]),
            ]


def test_token_ids_without_kv_events_is_refused(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="needs kv_events=True"):
        ClusterStore.start(1 << 20, kv_events_tokens=True, runtime_dir=str(tmp_path / "rd"))
    r = subprocess.run([sys.executable, "-m", "kvproc", "up", "--runtime-dir", str(tmp_path / "rd"),
                        "--kv-events-tokens"], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 2 and "needs --kv-events" in r.stderr
    assert not (tmp_path / "rd").exists()


def test_without_kv_events_a_reserve_save_carries_one_nil_byte_more() -> None:
    """The default save path's cost: one trailing slot (the wire's rule for new fields) carries all the tier's
    events need (parent page, token ids), None when off: one msgpack nil more per ReserveSave than before KV events,
    nothing else (msgspec writes an array-like struct's defaults: a second slot would be a second byte); a tier from
    before KV events reads it. (The slots after it are not the events': `reservation`, 1 byte when 0, 9 with the
    random id a store sends -- issue 39, item 8; `retain_s`, one nil without a retention hint -- issue 35.)"""
    import msgspec

    class Before(msgspec.Struct, array_like=True, omit_defaults=True, tag=305):  # ReserveSave before KV events
        req_id: str
        keys: list[bytes]
        bounded_groups: list[str]
        save_class: str

    args = ("r1", [b"k" * 16] * 8, ["state"], "cacheable")
    now, before = msgspec.msgpack.encode(m.ReserveSave(*args)), msgspec.msgpack.encode(Before(*args))
    assert len(now) == len(before) + 3 and now.endswith(b"\xc0\x00\xc0")  # events None, reservation 0, retain_s None
    assert msgspec.msgpack.decode(now, type=Before) == Before(*args)
    tokens = np.arange(32, dtype=np.int64).tobytes()
    with_events = m.ReserveSave(*args, events=m.SaveEvents(b"p" * 16, tokens))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(with_events), type=m.ReserveSave) == with_events


def test_without_kv_events_a_query_carries_one_nil_byte_more() -> None:
    """`Query.parent` (the page before the query's first, for the pages a tier pulls from Mooncake) costs a query
    one msgpack nil when the tier publishes no events (and `Query.claim`, after it, one byte when 0), and a tier from
    before both reads the query."""
    import msgspec

    class Before(msgspec.Struct, array_like=True, omit_defaults=True, tag=301):  # Query before `parent`
        req_id: str
        hashes: list[bytes]

    args = ("r1", [b"k" * 16] * 8)
    now, before = msgspec.msgpack.encode(m.Query(*args)), msgspec.msgpack.encode(Before(*args))
    assert len(now) == len(before) + 2 and now.endswith(b"\xc0\x00")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(m.Query(*args, b"p" * 16)), type=Before) == Before(*args)


def test_a_store_sends_a_parent_page_only_with_one_and_only_to_a_tier_that_publishes_events() -> None:
    """What `RemoteTier.reserve_save` puts in `ReserveSave.events` (`save_events`, given the parent only where the
    tier's Configured said kv_events and the tokens only where it said token_ids): a SaveEvents with what there is,
    or None."""
    from kvproc.tiers.remote import save_events

    tokens = np.arange(8, dtype=np.int64)
    assert save_events(None, b"p" * 16) == m.SaveEvents(b"p" * 16)
    assert save_events(tokens, b"p" * 16) == m.SaveEvents(b"p" * 16, tokens.tobytes())
    assert save_events(tokens, None) == m.SaveEvents(None, tokens.tobytes())  # the prompt's first page
    assert save_events(None, None) is None
