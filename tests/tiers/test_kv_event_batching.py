"""`KvEventPublisher` batches over an interval: a publish appends, the thread sends what gathered as one batch when
the interval ends, a flush or the stop asks, or `max_pending` events wait. Real sockets, a real publisher thread."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator

import pytest

from kvproc.tiers.kv_events import BlockRemoved, KvEventPublisher, decode_batch
from tests.conftest import replay_kv_events, wait_for

HOUR = 3600.0  # an interval no test waits out: whatever is sent was sent by a flush, the stop or max_pending


@pytest.fixture
def tmp() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="kvb")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _removed(i: int) -> BlockRemoved:
    return BlockRemoved([i.to_bytes(4, "big")])


def _sent(pub: KvEventPublisher) -> list[list[bytes]]:
    """Each kept batch's events' hashes, in seq order."""
    batches = replay_kv_events(pub.replay_endpoint)
    assert [s for s, _ in batches] == list(range(len(batches)))
    return [[h for e in decode_batch(p).events for h in e.block_hashes] for _, p in batches]  # type: ignore[union-attr]


def test_publishes_within_an_interval_go_out_as_one_batch_in_order_at_a_flush(tmp: str) -> None:
    pub = KvEventPublisher(tmp, 0, batch_interval_s=HOUR)
    try:
        for i in range(50):
            pub.publish([_removed(i)])
            time.sleep(0.002)  # the publisher's thread could run (it would, were it woken per publish)
        assert pub.seq == 0  # nothing sent yet: the interval has not ended and nobody asked
        assert pub.flush()
        assert pub.flush()  # nothing new: no empty batch
        pub.publish([_removed(50), _removed(51)])
        assert pub.flush()
        # coalesced: neighbouring removals are one event, so a batch's hashes are its events' in publish order
        assert _sent(pub) == [[i.to_bytes(4, "big") for i in range(50)], [(50).to_bytes(4, "big"), (51).to_bytes(4, "big")]]
        assert pub.stats()["kv_events.events"] == 52
    finally:
        pub.close()


def test_without_a_flush_the_interval_ends_the_batch(tmp: str) -> None:
    pub = KvEventPublisher(tmp, 0, batch_interval_s=0.02)
    try:
        pub.publish([_removed(1)])
        pub.publish([_removed(2)])
        wait_for(lambda: pub.seq >= 1, timeout=10, what="the interval's batch")
        pub.publish([_removed(3)])  # after a send: wakes the thread again
        wait_for(lambda: pub.seq >= 2, timeout=10, what="the next interval's batch")
        assert [h for b in _sent(pub) for h in b] == [i.to_bytes(4, "big") for i in (1, 2, 3)]
    finally:
        pub.close()


def test_max_pending_events_are_sent_without_waiting_out_the_interval(tmp: str) -> None:
    pub = KvEventPublisher(tmp, 0, batch_interval_s=HOUR, max_pending=8)
    try:
        pub.publish([_removed(i) for i in range(7)])
        pub.publish([_removed(7)])
        wait_for(lambda: pub.seq >= 1, timeout=10, what="the batch max_pending hurried")
        assert _sent(pub) == [[i.to_bytes(4, "big") for i in range(8)]]
    finally:
        pub.close()


def test_the_stop_sends_what_is_pending(tmp: str) -> None:
    pub = KvEventPublisher(tmp, 0, batch_interval_s=HOUR)
    pub.publish([_removed(1)])
    pub.close()
    assert pub.seq == 1 and pub.stats()["kv_events.events"] == 1


def test_the_replay_keeps_the_newest_batches_within_its_byte_bound_and_always_the_last(tmp: str) -> None:
    # batches of one removal of 4 KiB-long hashes (~4.1 KB each); a bound of 10 KB keeps the newest two
    pub = KvEventPublisher(tmp, 0, batch_interval_s=HOUR, replay_bytes=10_000)
    big = [bytes([i]) * 4096 for i in range(6)]
    try:
        for h in big:
            pub.publish([BlockRemoved([h])])
            assert pub.flush()
        kept = replay_kv_events(pub.replay_endpoint)
        assert [s for s, _ in kept] == [4, 5]  # the oldest went first; a replay from 0 starts at 4 (the gap shows)
        assert [decode_batch(p).events[0].block_hashes for _, p in kept] == [[big[4]], [big[5]]]  # type: ignore[union-attr]
        st = pub.stats()
        assert st["kv_events.replay_kept"] == 2 and st["kv_events.replay_kept_bytes"] == sum(len(p) for _, p in kept)
        pub.publish([BlockRemoved([b"x" * 20_000])])  # one batch over the bound on its own: still kept, alone
        assert pub.flush()
        assert [s for s, _ in replay_kv_events(pub.replay_endpoint)] == [6]
    finally:
        pub.close()
