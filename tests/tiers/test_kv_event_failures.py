"""A KV-event batch that fails in the publisher's thread is loud and safe: logged once with its traceback, counted
(`kv_events.failed` / `kv_events.dropped`, in `kvproc console status` and `/metrics`), its seq skipped so that a
subscriber sees a gap no replay fills, and the stream goes on with the next batch; nothing piles up. Real sockets,
a real publisher thread, a real encode failure (msgspec's encoder given an object it cannot encode)."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import tempfile
from collections.abc import Iterator

import pytest
import structlog
import zmq

from kvproc.core.hashing import PAD_TOKEN_ID
from kvproc.ipc import messages as m
from kvproc.native import NATIVE
from kvproc.runtime import console, launch
from kvproc.runtime import manifest as mf
from kvproc.runtime.config import RoleConfig
from kvproc.tiers.kv_events import (
    MEDIUM_DEVICE,
    TOPIC,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventPublisher,
    decode_batch,
)
from tests.conftest import cluster_store, compute, replay_kv_events, wait_for
from tests.runtime.test_metrics import scrape, value

HOUR = 3600.0  # no interval ends during a test: batches go out at a flush


@pytest.fixture
def tmp() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="kvf")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _removed(i: int) -> BlockRemoved:
    return BlockRemoved([i.to_bytes(4, "big")])


def test_a_batch_that_fails_to_encode_is_logged_once_counted_and_skipped_and_the_stream_goes_on(tmp: str) -> None:
    pub = KvEventPublisher(tmp, 0, batch_interval_s=HOUR)
    try:
        with structlog.testing.capture_logs() as logs:
            pub.publish([_removed(0)])
            assert pub.flush()
            # a real event the encoder cannot take (token ids must be ints): the batch fails in msgspec's encode
            pub.publish([_removed(1), BlockStored([b"k"], None, [object()], 4)])  # type: ignore[list-item]
            assert not pub.flush()  # the flush says its batch did not go out
            pub.publish([_removed(2), BlockStored([b"j"], None, [object()], 4)])  # type: ignore[list-item]
            assert not pub.flush()
            pub.publish([_removed(3)])
            assert pub.flush()  # the thread went on
        failures = [e for e in logs if e["event"] == "kv_events_batch_failed"]
        assert len(failures) == 1 and failures[0]["log_level"] == "error" and failures[0]["exc_info"] is True
        assert failures[0]["seq"] == 1 and failures[0]["events"] == 2
        stats = pub.stats()
        assert stats["kv_events.failed"] == 2 and stats["kv_events.dropped"] == 4
        assert stats["kv_events.queued"] == 6 and stats["kv_events.events"] == 2 and stats["kv_events.seq"] == 4
        kept = replay_kv_events(pub.replay_endpoint)
        assert [s for s, _ in kept] == [0, 3]  # seqs 1 and 2 skipped: a gap a subscriber sees, and no replay fills
        assert [e.block_hashes for _, p in kept for e in decode_batch(p).events] == [  # type: ignore[union-attr]
            [(0).to_bytes(4, "big")], [(3).to_bytes(4, "big")]]
        # nothing waits in the pending list for a batch that will never be sent
        assert not pub._pending
    finally:
        pub.close()


class _TestOnlyDyingPublisher(KvEventPublisher):
    """The publisher's thread ends on a failure outside a batch (a bug the per-batch guard does not catch)."""

    def _send_or_drop(self, events: list) -> None:  # type: ignore[type-arg]
        raise SystemExit("test-only: the publisher's thread ends")


def test_a_publisher_whose_thread_ended_drops_publishes_and_answers_flush_at_once(tmp: str) -> None:
    pub = _TestOnlyDyingPublisher(tmp, 0, batch_interval_s=HOUR)
    try:
        with structlog.testing.capture_logs() as logs:
            pub.publish([_removed(0)])
            assert not pub.flush(timeout=30)
            wait_for(lambda: not pub._threads[0].is_alive(), timeout=30, what="the thread's end")
        assert [e["event"] for e in logs if e["log_level"] == "error"] == ["kv_events_publisher_died"]
        for i in range(1, 1001):
            pub.publish([_removed(i)])
        stats = pub.stats()  # none kept for a thread that is gone; all counted: queued = events + dropped
        assert not pub._pending and stats["kv_events.dropped"] == stats["kv_events.queued"] == 1001
        assert not pub.flush(timeout=30)  # answered at once, not after the timeout: nothing to wait for
    finally:
        pub.close()


needs_native = pytest.mark.skipif(NATIVE is None, reason="kvproc.native._native not built")


def _device_publisher(tmp: str, cls: type[KvEventPublisher] = KvEventPublisher) -> tuple[KvEventPublisher, object]:
    pub = cls(tmp, 0, kind="device", batch_interval_s=HOUR)
    log = NATIVE.EventLog(4, MEDIUM_DEVICE, PAD_TOKEN_ID, pub.max_pending, pub.hurry)  # type: ignore[union-attr]
    pub.use_log(log)
    return pub, log


@needs_native
def test_a_device_batch_with_a_change_the_log_refused_fails_counted_and_skipped_and_the_stream_goes_on(
        tmp: str) -> None:
    """The compiled log (a device pool's listener) never raises where the pool reports a change: a change it cannot
    encode fails its batch in the publisher's thread, as msgspec's failure does: logged once, counted, its seq
    skipped, and the next batch whole."""
    pub, log = _device_publisher(tmp)
    try:
        with structlog.testing.capture_logs() as logs:
            log.removed([_key(0)])  # type: ignore[attr-defined]
            assert pub.flush()
            log.removed([_key(1)])  # type: ignore[attr-defined]
            log.stored([b"k" * 16], [0], [1, 2.5, 3, 4])  # type: ignore[attr-defined]  # a token that is no int
            assert not pub.flush()
            log.removed([_key(2)])  # type: ignore[attr-defined]
            assert pub.flush()
        failures = [e for e in logs if e["event"] == "kv_events_batch_failed"]
        assert len(failures) == 1 and failures[0]["seq"] == 1 and failures[0]["events"] == 2
        stats = pub.stats()
        assert stats["kv_events.failed"] == 1 and stats["kv_events.dropped"] == 2
        assert stats["kv_events.queued"] == 4 and stats["kv_events.events"] == 2 and stats["kv_events.seq"] == 3
        kept = replay_kv_events(pub.replay_endpoint)
        assert [s for s, _ in kept] == [0, 2]
        assert [e.block_hashes for _, p in kept for e in decode_batch(p).events] == [  # type: ignore[union-attr]
            [_key(0)], [_key(2)]]
    finally:
        pub.close()


class _TestOnlyDyingLogPublisher(KvEventPublisher):
    """A device publisher whose thread ends on a failure outside a batch."""

    def _send_log(self) -> None:
        raise SystemExit("test-only: the publisher's thread ends")


@needs_native
def test_a_device_publisher_whose_thread_ended_stops_keeping_the_logs_changes(tmp: str) -> None:
    pub, log = _device_publisher(tmp, _TestOnlyDyingLogPublisher)
    try:
        with structlog.testing.capture_logs():
            log.removed([_key(0)])  # type: ignore[attr-defined]
            assert not pub.flush(timeout=30)
            wait_for(lambda: not pub._threads[0].is_alive(), timeout=30, what="the thread's end")
        for i in range(1, 1001):
            log.removed([_key(i)])  # type: ignore[attr-defined]
        pub.publish([_removed(1001)])
        stats = pub.stats()  # nothing kept; all counted: queued = dropped
        assert log.records == 0 and stats["kv_events.dropped"] == stats["kv_events.queued"] == 1002  # type: ignore[attr-defined]
        assert not pub.flush(timeout=30)
    finally:
        pub.close()


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


def test_a_host_tier_whose_batch_fails_counts_it_in_console_status_and_metrics_and_a_subscriber_sees_the_gap(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    rd = str(tmp_path / "rd")
    # a host-tier cluster (what `kvproc up` runs) whose first KV-event batch fails to encode (the tier's test-only
    # option); an engine attaches to it as to any shared tier
    tier_opts = {"host_bytes": 8 << 20, "kv_events": True, "kv_events_interval_s": 0.01,
                 "test_only_poison_kv_event_batches": 1}
    with launch([RoleConfig("host_tier", 0, options=tier_opts)], cluster_name="kvfail", runtime_dir=rd,
                metrics="127.0.0.1:0") as cluster:
        tier = cluster.client("host_tier")
        published = next(p.published for p in mf.read_manifest(rd).processes if p.role == "host_tier")
        sub = zmq.Context.instance().socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        sub.connect(published["kv_events"])
        try:
            with cluster_store(1 << 20, tier_runtime_dir=rd) as (_cs, store, model):
                # Configure's AllBlocksCleared is the first batch: it fails (seq 0 skipped)
                wait_for(lambda: tier.request(m.Stats(), timeout=5).counters["kv_events.failed"] == 1, timeout=60,
                         what="the poisoned batch")
                for i in range(4):
                    kv, cur, _, _ = compute(store, model, f"r{i}", [1000 * i + j for j in range(17)])
                    store.retire(0, kv, cur)
                    store.flush_saves(0, 10)
                wait_for(lambda: (c := tier.request(m.Stats(), timeout=5).counters)["kv_events.events"]
                         + c["kv_events.dropped"] == c["kv_events.queued"], timeout=60, what="every batch settled")
                c = tier.request(m.Stats(), timeout=5).counters
                assert c["kv_events.failed"] == 1 and c["kv_events.dropped"] == 1 and c["kv_events.events"] >= 4
                # a subscriber: the live stream starts at seq 1 (0 never went out), the replay has no 0 either
                live = []
                while sub.poll(1000):
                    _, seq, _payload = sub.recv_multipart()
                    live.append(int.from_bytes(seq, "big", signed=True))
                assert live and live[0] == 1 and live == list(range(1, len(live) + 1))
                kept = replay_kv_events(published["kv_events_replay"])
                assert [s for s, _ in kept] == list(range(1, c["kv_events.seq"]))
                assert not any(isinstance(e, AllBlocksCleared) for _, p in kept for e in decode_batch(p).events)
                # what an operator reads: the console's table (as JSON) and /metrics
                out = io.StringIO()
                with contextlib.redirect_stdout(out):
                    assert console.main(["status", "--json", "--runtime-dir", rd]) == 0
                status = json.loads(out.getvalue())
                assert _find(status, "kv_events.failed") == 1
                got = scrape(cluster.metrics.address)
                assert value(got, "kvproc:counter", role="host_tier", rank="0", name="kv_events.failed") == 1
                assert value(got, "kvproc:counter", role="host_tier", rank="0", name="kv_events.dropped") == 1
        finally:
            sub.close()


def _find(obj: object, key: str) -> object:
    """The value of `key` anywhere in the console's JSON (its shape groups counters by process)."""
    if isinstance(obj, dict):
        if key in obj:
            return obj[key]
        for v in obj.values():
            if (found := _find(v, key)) is not None:
                return found
    if isinstance(obj, list):
        for v in obj:
            if (found := _find(v, key)) is not None:
                return found
    return None

