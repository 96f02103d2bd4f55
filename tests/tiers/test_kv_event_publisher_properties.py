"""Property (hypothesis): `KvEventPublisher`'s producers append without a lock (`put` / `publish`: `deque.append` /
`extend`), so what several threads publish at once, with flushes and `max_pending` hurries between, must still go
out exactly once each, every producer's events in its own order, records (`(REMOVED, keys)`, as a device pool queues
them) encoded with the events around them, and the counters conserved (`queued == events`, nothing dropped, one seq
per batch). The same through a device pool's compiled log (`use_log`: producers append to the `EventLog` as the pool
does, and publish events through the publisher, which logs them too; `max_pending` hurries come from the log).
Real sockets, a real publisher thread; the batches are read back through the replay endpoint."""

from __future__ import annotations

import shutil
import tempfile
import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from kvproc.core.hashing import PAD_TOKEN_ID
from kvproc.native import NATIVE
from kvproc.tiers.device_index_events import REMOVED, DeviceBatchEncoder
from kvproc.tiers.kv_events import MEDIUM_DEVICE, BlockRemoved, KvEventPublisher, decode_batch
from tests.conftest import replay_kv_events


def _key(producer: int, i: int) -> bytes:
    return producer.to_bytes(2, "big") + i.to_bytes(4, "big")


@settings(max_examples=12, deadline=None)
@given(
    per_producer=st.lists(st.integers(1, 400), min_size=1, max_size=4),
    chunk=st.integers(1, 7),
    interval_ms=st.sampled_from([1, 5, 50]),
    max_pending=st.sampled_from([3, 64, 4096]),
    flushes=st.integers(0, 5),
    logged=st.sampled_from([False, True] if NATIVE is not None else [False]),
)
def test_concurrent_producers_each_event_goes_out_once_in_each_producers_order(
        per_producer: list[int], chunk: int, interval_ms: int, max_pending: int, flushes: int, logged: bool) -> None:
    tmp = tempfile.mkdtemp(prefix="kvpp")
    pub = KvEventPublisher(tmp, 0, batch_interval_s=interval_ms / 1000, max_pending=max_pending)
    if logged:  # a device pool's way: records appended to the log (a removal, a registration of one key)
        log = NATIVE.EventLog(16, MEDIUM_DEVICE, PAD_TOKEN_ID, max_pending, pub.hurry)  # type: ignore[union-attr]
        pub.use_log(log)
        record = log.removed
        one = lambda key: log.stored([key], [0])
    else:
        pub.encode_batch = DeviceBatchEncoder(16)  # records and events both
        record = lambda keys: pub.put((REMOVED, keys))
        one = lambda key: pub.put(BlockRemoved([key]))
    try:
        start = threading.Barrier(len(per_producer) + 1)

        def produce(p: int, n: int) -> None:
            start.wait()
            i = 0
            while i < n:  # alternate the three ways in: a record, an event, a list of events
                if i % 3 == 0:
                    record([_key(p, i)])
                    i += 1
                elif i % 3 == 1:
                    one(_key(p, i))
                    i += 1
                else:
                    k = min(chunk, n - i)
                    pub.publish([BlockRemoved([_key(p, i + j)]) for j in range(k)])
                    i += k

        threads = [threading.Thread(target=produce, args=(p, n)) for p, n in enumerate(per_producer)]
        for t in threads:
            t.start()
        start.wait()
        for _ in range(flushes):  # flushes racing the producers: each answers True (nothing failed)
            assert pub.flush(timeout=30)
        for t in threads:
            t.join(30)
        assert pub.flush(timeout=30)
        batches = replay_kv_events(pub.replay_endpoint)
        assert [s for s, _ in batches] == list(range(len(batches))) == list(range(pub.seq))
        sent = [h for _, payload in batches for e in decode_batch(payload).events
                for h in e.block_hashes]  # type: ignore[union-attr]
        total = sum(per_producer)
        assert len(sent) == len(set(sent)) == total  # each once
        for p, n in enumerate(per_producer):  # each producer's in its own order
            assert [h for h in sent if h[:2] == p.to_bytes(2, "big")] == [_key(p, i) for i in range(n)]
        stats = pub.stats()
        assert stats["kv_events.queued"] == stats["kv_events.events"] == total
        assert stats["kv_events.dropped"] == stats["kv_events.failed"] == 0
        assert stats["kv_events.batches"] == pub.seq
    finally:
        pub.close()
        shutil.rmtree(tmp, ignore_errors=True)
