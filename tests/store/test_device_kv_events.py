"""Device-pool KV events (issue 21): rank 0's publisher, in the store's own process, lets a subscriber rebuild the
device prefix index's key set from the events alone, through device evictions, a re-registered page, a displaced
duplicate (two requests computing one prompt), `drop_device_cache` and restores from the host tier; the endpoints are
in the manifest; and a subscriber that misses one kind of event ends with another set (the control). Each stored page
carries its token ids (vLLM's `BlockStored.token_ids`), computed or restored."""

from __future__ import annotations

import numpy as np
import zmq

from kvproc import RequestKv
from kvproc.core.hashing import PAD_TOKEN_ID
from kvproc.runtime import manifest as mf
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
from tests.conftest import PAGE, admit, cluster_store, compute, replay_kv_events


def _rebuild(batches: list[KVEventBatch], drop: type | None = None,
             tokens: dict[bytes, list[int]] | None = None) -> tuple[set[bytes], dict[str, int]]:
    """The key set the events leave; `tokens` (when given) collects each stored page's token ids from the events
    that carry them (`seen["untokened"]` counts the pages stored without)."""
    keys: set[bytes] = set()
    seen = {"stored": 0, "removed": 0, "cleared": 0, "untokened": 0}
    for batch in batches:
        for e in batch.events:
            if drop is not None and isinstance(e, drop):
                continue
            if isinstance(e, AllBlocksCleared):
                keys.clear()
                seen["cleared"] += 1
            elif isinstance(e, BlockStored):
                assert drop or not keys & set(e.block_hashes), "a key stored twice without a removal between"
                assert e.medium == "GPU" and e.block_size == PAGE
                if e.token_ids:  # vLLM's layout: the pages' tokens, one page after the other
                    assert len(e.token_ids) == PAGE * len(e.block_hashes)
                    for i, h in enumerate(e.block_hashes):
                        if tokens is not None:
                            tokens[h] = e.token_ids[i * PAGE:(i + 1) * PAGE]
                else:
                    seen["untokened"] += len(e.block_hashes)
                keys.update(e.block_hashes)
                seen["stored"] += len(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                assert drop or set(e.block_hashes) <= keys, "a key removed that was never stored"
                assert e.medium == "GPU"
                keys.difference_update(e.block_hashes)
                seen["removed"] += len(e.block_hashes)
    return keys, seen


def test_a_subscriber_rebuilds_rank0s_device_index_from_events_alone() -> None:
    with cluster_store(1 << 20, kv_events=True, device_kv_events=True) as (cs, store, model):  # 32 device blocks: the workload evicts
        pool = store.pools[0]
        manifest = mf.read_manifest(cs.cluster.runtime_dir)
        pub_ep, replay_ep = endpoints(cs.cluster.runtime_dir, 0, "device")
        assert manifest.published == {"kv_events_device_0": pub_ep, "kv_events_device_replay_0": replay_ep,
                                      "kv_events_device_interval_ms": "50"}
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.connect(pub_ep)
        try:
            # 12 prompts of 4 full pages (+1 token): 60 blocks' worth through 32, saved to the host tier
            expected: dict[bytes, list[int]] = {}  # page hash -> its tokens, for every page the test makes

            def pages_of(kv: RequestKv, toks: list[int]) -> None:
                expected.update((h, toks[k * PAGE:(k + 1) * PAGE]) for k, h in enumerate(kv.page_hashes[:4]))

            for i in range(12):
                kv, cur, _, _ = compute(store, model, f"r{i}", toks := [1000 * i + j for j in range(17)])
                pages_of(kv, toks)
                store.retire(0, kv, cur)
                # each save lands before the next prompt: with saves in flight pinning blocks of the 32, a slow
                # machine shed some (`save.shed.pin_pressure`) and the restore below then missed the host tier
                store.flush_saves(0, 10)
            assert pool.paged.evictions > 0
            # a page registered again (the same blocks): the index keeps its entry, no event
            kv, cur, _, _ = compute(store, model, "again", [1000 * 11 + j for j in range(17)])
            with pool.lock:
                pool.paged.register(kv.block_ids[:4], kv.page_hashes[:4])
            store.retire(0, kv, cur)
            # a displaced duplicate: two requests compute one new prompt side by side; the second's blocks take
            # the keys, the first's keep their hashes and age out without a removal
            toks = [777_000 + j for j in range(17)]
            kvs = []
            for rid in ("dupA", "dupB"):
                kvx, _ = admit(store, rid, toks, hit_blocks=0)
                kvs.append(kvx)
            for kvx in kvs:
                kvx.apply()
                pages_of(kvx, toks)
            displaced, dup_keys = list(kvs[0].block_ids[:4]), list(kvs[0].page_hashes[:4])
            assert [pool.paged.index[h] for h in dup_keys] == kvs[1].block_ids[:4]
            for kvx in kvs:  # one after the other: dupA's blocks enter the LRU first
                store.retire(0, kvx, SealCursor.after_prefix(0))
                store.flush_saves(0, 10)
            with pool.lock:  # evict every cached block but the newest 4 (dupB's): the displaced ones go
                taken = pool.paged.allocate(pool.paged.available - 4)
                pool.paged.release(taken)
            with pool.lock:  # the displaced blocks were evicted (lost their hashes) while their keys stayed indexed
                assert all(pool.paged.block_hash[b] != h for b, h in zip(displaced, dup_keys))
                assert set(dup_keys) <= set(pool.paged.index)
            assert store.drop_device_cache(0) > 0
            kv, cur, prefix, _ = compute(store, model, "restored", toks := [1000 * 5 + j for j in range(17)])
            assert prefix.host_tokens == 16, store.stats()  # restored from the host tier: registered again, new keys
            pages_of(kv, toks)
            kept_kv = kv  # still active when the events are read: its keys stay indexed

            pub = cs.device_events.publishers[0]  # type: ignore[union-attr]
            assert pub.flush()
            kept = replay_kv_events(replay_ep)
            seqs = [s for s, _ in kept]
            assert seqs == list(range(pub.seq)), "a gap or a reordering in the batches' seq"
            batches = [decode_batch(p) for _, p in kept]
            assert isinstance(batches[0].events[0], AllBlocksCleared)
            with pool.lock:
                index_keys = set(pool.paged.index)
            got_tokens: dict[bytes, list[int]] = {}
            keys, seen = _rebuild(batches, tokens=got_tokens)
            assert seen["removed"] > 0 and seen["stored"] > seen["removed"]
            assert keys == index_keys and set(kept_kv.page_hashes[:4]) <= keys
            # every stored page, computed or restored, carried its own tokens (the restored ones: the prompt's)
            assert seen["untokened"] == 0 and got_tokens == {h: expected[h] for h in got_tokens}
            assert set(kept_kv.page_hashes[:4]) <= set(got_tokens)
            # controls: missing the removals, or the stores, gives another set
            assert _rebuild(batches, drop=BlockRemoved)[0] != index_keys
            assert _rebuild(batches, drop=BlockStored)[0] != index_keys
            # the live stream carried the same batches (those after the subscriber connected)
            live: list[tuple[int, bytes]] = []
            while sub.poll(200):
                topic, seq, payload = sub.recv_multipart()
                assert topic == TOPIC
                live.append((int.from_bytes(seq, "big", signed=True), payload))
            assert live and live == kept[len(kept) - len(live):]
            counters = cs.cluster.counters()
            assert counters.get("rank0.kv_events.seq") == pub.seq
            store.retire(0, kept_kv, cur)
        finally:
            sub.close()


def test_without_kv_events_no_device_publisher_and_nothing_in_the_manifest() -> None:
    with cluster_store() as (cs, store, _):
        assert cs.device_events is None and store.pools[0].paged.listener is None
        assert mf.read_manifest(cs.cluster.runtime_dir).published == {}


def test_an_in_process_store_publishes_too_from_what_its_index_already_holds() -> None:
    """`DevicePublishers.start` on a store that has pages indexed already: the stream starts with them (after
    `AllBlocksCleared`), then follows the churn."""
    import shutil
    import tempfile

    from kvproc.store.device_events import DevicePublishers
    from tests.store.conftest import churn as churn_local
    from tests.store.conftest import compute as compute_local
    from tests.store.conftest import make_store

    store, model, _, _ = make_store(16, tier=False)
    tmp = tempfile.mkdtemp(prefix="kvd")
    try:
        kv, _, _, _ = compute_local(store, model, "before", list(range(17)))
        kv.release()
        pubs = DevicePublishers.start(store, tmp)
        try:
            for i in range(6):
                kv, _, _, _ = compute_local(store, model, f"r{i}", [100 * (i + 1) + j for j in range(9)])
                kv.release()
            churn_local(store)
            kv, _, _, _ = compute_local(store, model, "after", list(range(17)))
            kv.release()
            assert pubs.publishers[0].flush()
            batches = [decode_batch(p) for _, p in replay_kv_events(pubs.publishers[0].replay_endpoint)]
            first = batches[0].events
            assert isinstance(first[0], AllBlocksCleared) and isinstance(first[1], BlockStored)
            assert len(first[1].block_hashes) == 4  # "before"'s pages, indexed when the publisher started
            keys, seen = _rebuild(batches)
            assert seen["removed"] > 0
            assert keys == set(store.pools[0].paged.index)
            assert seen["untokened"] == 4  # only the pages indexed before the publisher started: tokens unknown
        finally:
            pubs.close()
        assert store.pools[0].paged.listener is None
    finally:
        store.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_a_registration_with_gaps_is_one_stored_event_per_run_with_its_parent() -> None:
    import shutil
    import tempfile

    from kvproc.tiers.device_index_events import DeviceIndexEvents
    from kvproc.tiers.kv_events import KvEventPublisher

    tmp = tempfile.mkdtemp(prefix="kvd")
    pub = KvEventPublisher(tmp, 0, kind="device")
    try:
        h = [bytes([i]) * 16 for i in range(7)]
        events = DeviceIndexEvents(pub, PAGE)
        toks = np.arange(7 * PAGE - 1, dtype=np.int64)  # page i: tokens i*PAGE.., the last one a token short
        events.stored(h, [0, 1, 3, 5, 6], toks)  # 2 and 4 were indexed already
        events.stored(h, [2, 3, 4], toks.tolist())  # tokens as a list: the same token_ids
        events.stored(h, [0])  # tokens unknown (a bare register): none
        assert pub.flush()
        got = [e for _, p in replay_kv_events(pub.replay_endpoint) for e in decode_batch(p).events]
        assert [(e.block_hashes, e.parent_block_hash) for e in got] == [
            ([h[0], h[1]], None), ([h[3]], h[2]), ([h[5], h[6]], h[4]), ([h[2], h[3], h[4]], h[1]), ([h[0]], None)]

        def pages(*ps: int) -> list[int]:  # a short last page is padded, as the page itself was
            return [t if t < 7 * PAGE - 1 else PAD_TOKEN_ID for p in ps for t in range(p * PAGE, (p + 1) * PAGE)]

        assert [e.token_ids for e in got] == [pages(0, 1), pages(3), pages(5, 6), pages(2, 3, 4), []]
    finally:
        pub.close()
        shutil.rmtree(tmp, ignore_errors=True)


def test_pages_restored_after_a_device_hit_carry_their_own_token_ids_and_parent() -> None:
    """A resolve that finds the head of a prompt on the device and the rest in the host tier registers only the rest:
    its `BlockStored` starts at the prompt's third page, so its token ids are the prompt's from there on (the pool
    passes the whole prompt and where the restored pages start; the publisher's thread slices it), and its parent is
    the prompt's second page, not None. Likewise pages computed after a prefix hit."""
    with cluster_store(1 << 20, device_kv_events=True) as (cs, store, model):
        pool = store.pools[0]
        toks = [5000 + j for j in range(4 * PAGE + 1)]
        kv, cur, _, _ = compute(store, model, "first", toks)
        hashes = list(kv.page_hashes[:4])
        store.retire(0, kv, cur)
        store.flush_saves(0, 10)
        with pool.lock:  # evict two cached blocks: a chain's tail goes first, so pages 2 and 3 leave the device
            taken = pool.paged.allocate(len(pool.paged.free) + 2)
            pool.paged.release(taken)
            assert set(hashes[:2]) <= set(pool.paged.index) and not set(hashes[2:]) & set(pool.paged.index)
        prefix = store.resolve_prefix_sync(0, "second", toks)
        try:
            assert (prefix.device_tokens, prefix.host_tokens) == (2 * PAGE, 2 * PAGE), store.stats()
            pub = cs.device_events.publishers[0]  # type: ignore[union-attr]
            assert pub.flush()
            stored = [e for _, p in replay_kv_events(pub.replay_endpoint) for e in decode_batch(p).events
                      if isinstance(e, BlockStored) and e.block_hashes == hashes[2:]]
            assert len(stored) == 1
            assert stored[0].token_ids == toks[2 * PAGE:4 * PAGE] and stored[0].parent_block_hash == hashes[1]
        finally:
            prefix.hold.release()
        # pages computed after a prefix hit (the four pages above, now all on the device): their parent is the
        # prefix's last page, their tokens their own
        longer = toks[:4 * PAGE] + [9000 + j for j in range(2 * PAGE + 1)]
        kv, cur, prefix, _ = compute(store, model, "third", longer)
        assert prefix.device_tokens == 4 * PAGE
        assert pub.flush()
        stored = [e for _, p in replay_kv_events(pub.replay_endpoint) for e in decode_batch(p).events
                  if isinstance(e, BlockStored) and e.block_hashes == list(kv.page_hashes[4:6])]
        assert len(stored) == 1
        assert stored[0].token_ids == longer[4 * PAGE:6 * PAGE] and stored[0].parent_block_hash == hashes[3]
        store.retire(0, kv, cur)
