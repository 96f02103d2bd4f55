"""KV events: what a host tier stores and removes, published for KV-aware routers (llm-d, Dynamo, SGLang's router).

The events have the shape of vLLM's own (`KVEventBatch` of `BlockStored` / `BlockRemoved` / `AllBlocksCleared`,
msgspec msgpack, array-like, tagged), so a router that reads vLLM's stream reads this one:

- `BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium)`: pages committed, one event per
  run of consecutive new pages of one save; `parent_block_hash` is the prompt's page before the run, None only at the
  prompt's first page (at a save's first page it is the one the store sends with the save, `SaveEvents.parent_key`;
  at the first page of a run a tier pulls from a Mooncake Store below it, the one the store sends with the query,
  `Query.parent`; such pages are published once the pull commits); `token_ids` the run's
  pages' tokens, one page after the other, when the tier was started with `kv_events_tokens` (the stores then send
  each save's tokens), else empty; `medium` is "CPU" (vLLM's `MEDIUM_CPU`);
- `BlockRemoved(block_hashes, medium)`: pages evicted;
- `AllBlocksCleared()`: the first batch of a tier incarnation (a subscriber drops what an earlier one held).

A batch is what changed over up to `batch_interval_s` (50 ms by default; sooner at `flush`, the stop or `max_pending`
events), in change order: the changing thread only appends (`KvEventPublisher`), so a router sees a change ~50 ms late
at most (vLLM's own publisher sends once per engine step, tens of ms). The interval is an operator's setting
(`ClusterStore.start(kv_events_interval_s=)`, `kvproc up --kv-events-interval-ms`; `check_interval` bounds it).

Transport (vLLM's convention): a ZeroMQ PUB socket sends `[topic, seq (8 bytes, big-endian), payload]` per batch;
`seq` grows by one per batch, so a gap is visible. A ROUTER socket beside it answers a replay request (the 8-byte
start seq) with every kept batch from there, `[seq, payload]` each, then `[-1, b""]`. The last `replay_batches`
batches are kept, at most `replay_bytes` of them (the newest always): a device pool's batches with token ids run to
~130 KB each on a busy engine, and 10,000 of them would be over 1 GB of the engine's memory. Endpoints:
`ipc://<runtime dir>/kv-events-<rank>` and `.../kv-events-replay-<rank>` (`endpoints()`). Off unless the tier is
started with `kv_events` (`ClusterStore.start(kv_events=True)`, `kvproc up --kv-events`).

Each rank's device pool publishes the same way (`tiers/device_index_events.py`, medium "GPU" as vLLM names its own,
endpoints `kv-events-device-<rank>` / `kv-events-device-replay-<rank>`), from the engine's process: what its prefix
index holds, i.e. which page hashes a resolve there would match; its `BlockStored` carry the pages' token ids.
"""

from __future__ import annotations

import collections
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Union

import msgspec
import numpy as np
import structlog
import zmq

from kvproc.core.hashing import PAD_TOKEN_ID
from kvproc.runtime.event_interval import DEFAULT_INTERVAL_S, check_interval

log = structlog.get_logger("kvproc.kv_events")

MEDIUM = "CPU"  # vLLM's MEDIUM_CPU: a router filtering on vLLM's constant sees the host tier's pages
MEDIUM_DEVICE = "GPU"  # vLLM's MEDIUM_GPU: what routers already read for an engine's own prefix cache
TOPIC = b"kv-events"
END = (-1).to_bytes(8, "big", signed=True)
# How often the publisher's thread looks at what gathered (at most: an interval shorter than this is its tick): a
# `max_pending` reached by `put`, the hot path, is seen within one tick.
TICK_S = 0.05
REPLAY_BATCHES = 10_000  # batches kept for replay: at most this many,
REPLAY_BYTES = 64 << 20  # and at most this many bytes of them (the newest batch always)
STOP_LINGER_MS = 1000  # how long a stopping publisher lets ZeroMQ write its last batches to connected subscribers
class BlockStored(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM


class BlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    block_hashes: list[bytes]
    medium: str | None = MEDIUM


class AllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


KvEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[KvEvent]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)


def decode_batch(payload: bytes) -> KVEventBatch:
    return _decoder.decode(payload)


def endpoints(runtime_dir: str, rank: int, kind: str = "") -> tuple[str, str]:
    """(PUB endpoint, replay endpoint) of rank `rank`'s host tier (`kind` "") or device pool (`kind` "device")."""
    k = f"{kind}-" if kind else ""
    return (f"ipc://{os.path.join(runtime_dir, f'kv-events-{k}{rank}')}",
            f"ipc://{os.path.join(runtime_dir, f'kv-events-{k}replay-{rank}')}")


def read_replay(endpoint: str, start: int = 0, timeout_ms: int = 10_000) -> Iterator[tuple[int, bytes]]:
    """The subscriber's side of a replay (`KvEventPublisher._answer_replay`): every (seq, payload) the publisher at
    `endpoint` still keeps from seq `start` on, in order. TimeoutError when a frame does not come within
    `timeout_ms` (what came before it was yielded already)."""
    s: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, timeout_ms)
    s.connect(endpoint)
    try:
        s.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        while True:
            try:
                _, seq, payload = s.recv_multipart()
            except zmq.Again:
                raise TimeoutError(f"no replay frame from {endpoint} within {timeout_ms} ms") from None
            if seq == END:
                return
            yield int.from_bytes(seq, "big", signed=True), payload
    finally:
        s.close(linger=0)


def page_token_ids(tokens: Any, start: int, stop: int, page_tokens: int) -> Any:
    """Pages `start..stop-1`'s token ids from a registration's `tokens` (`IndexListener.stored`; a host-tier save's
    `ReserveSave.events`): [] when unknown. Not copied (the registering side never changes them:
    `IndexListener.stored`), and an int64 array stays an array -- turned into a list by the publisher's thread as
    it encodes (`_enc_hook`), not here under the pool's (or the tier's) lock. A last page shorter than a page (a
    padded hand-off tail) is padded with `PAD_TOKEN_ID`, as the page itself was."""
    if tokens is None:
        return []
    if type(tokens) is bytes:  # a prompt's packed ids (`PageHashes.data`, what a restore registers)
        tokens = np.frombuffer(tokens, dtype="<u4")
    n = (stop - start) * page_tokens
    if start == 0 and len(tokens) == n:  # the whole registration (a prefill's new pages): as it is
        return tokens
    out = tokens[start * page_tokens:stop * page_tokens]
    if len(out) == n:
        return out
    if isinstance(out, np.ndarray):
        return np.concatenate((out, np.full(n - len(out), PAD_TOKEN_ID, dtype=out.dtype)))
    return list(out) + [PAD_TOKEN_ID] * (n - len(out))


def _enc_hook(obj: Any) -> Any:
    if isinstance(obj, (np.ndarray, np.generic)):  # `BlockStored.token_ids` (`page_token_ids`)
        return obj.tolist()
    raise NotImplementedError(f"cannot encode {type(obj).__name__}")


def event_encoder() -> msgspec.msgpack.Encoder:
    """The events' msgpack encoder (token-id arrays become lists as they are encoded)."""
    return msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def coalesce(events: list[KvEvent]) -> list[KvEvent]:
    """Neighbouring removals become one event (evictions come a page at a time)."""
    out: list[KvEvent] = []
    for e in events:
        if isinstance(e, BlockRemoved) and out and isinstance(out[-1], BlockRemoved) and out[-1].medium == e.medium:
            out[-1] = BlockRemoved(out[-1].block_hashes + e.block_hashes, e.medium)
        else:
            out.append(e)
    return out


class KvEventPublisher:
    """Publishes on a thread of its own (a ZeroMQ socket belongs to one thread), in batches gathered over
    `batch_interval_s`. A change costs its producer one `deque.append` (`put`: an event, or a record `encode_batch`
    takes, `DeviceIndexEvents` without C), or one `extend` (`publish`): no lock, no counter, no thread wake per call.
    Both are atomic under the GIL, so the deque holds the changes in the order they happened. A device pool's
    publisher takes its changes from a compiled log instead (`use_log`: appended in C under the pool's lock, each
    batch written from it in one call); its deque then carries only flush markers. The thread looks at the
    deque every `min(batch_interval_s, TICK_S)` and sends what gathered as one batch once an interval has passed since
    the last (sooner when a `flush`, the stop or `max_pending` events ask). Why a tick and not a wake by the first
    change of an interval: the wake's lock, flag and counter cost a device pool's resolve ~1 us more
    (bench/RESULTS.md, "Observability overhead"), the tick 20 wakes a second of an otherwise idle thread. Waking the
    thread and sending per change cost a blocking resolve +21% to +61% (`kvproc bench ipc --observe-ab
    --device-events`, 2 cores). Replays are answered on another thread, from the kept batches.

    A batch that fails to encode or send is dropped, and the thread goes on with the next one: one bad batch (an
    event the encoder cannot take, a socket error) must not end the stream of every later change, and taking the
    deque whole each interval keeps it bounded either way. Its seq is skipped (a batch that failed before it was
    kept), so a subscriber sees the gap and that no replay fills it: its view of this source is then incomplete. The
    first failure is logged with its traceback, every one counted (`kv_events.failed` batches, `kv_events.dropped`
    events). Should the thread itself end (a failure outside a batch), `put` and `publish` stop keeping what they
    are given (counted as dropped) and `flush` answers False at once: nothing waits for a thread that is gone."""

    def __init__(self, runtime_dir: str, rank: int, replay_batches: int = REPLAY_BATCHES, kind: str = "",
                 batch_interval_s: float = DEFAULT_INTERVAL_S, max_pending: int = 4096,
                 replay_bytes: int = REPLAY_BYTES) -> None:
        self.pub_endpoint, self.replay_endpoint = endpoints(runtime_dir, rank, kind)
        self.batch_interval_s = check_interval(batch_interval_s)  # before any socket or thread: nothing to undo
        self.max_pending = max_pending
        # Events (or records `encode_batch` takes) in publish order, and flush markers (set once everything before them
        # was sent). Producers append, the thread pops: both atomic, so neither needs a lock.
        self._pending: collections.deque[Any] = collections.deque()
        # The hot path (`DeviceIndexEvents`): one event or record; rebound to a dropping one if the thread ends, so
        # that nothing piles up for it.
        self.put: Callable[[Any], None] = self._pending.append
        self._extend: Callable[[list[Any]], None] = self._pending.extend
        self._markers = 0  # flush markers in `_pending` (not events: `stats` leaves them out of `queued`)
        self._markers_lock = threading.Lock()
        self._stopping = False
        self._hurry = threading.Event()  # send it now: a flush, the stop, or `max_pending` reached
        self._kept: collections.deque[tuple[int, bytes]] = collections.deque()
        self._kept_bytes = 0  # the kept payloads' bytes
        self.replay_batches, self.replay_bytes = replay_batches, replay_bytes
        self._kept_lock = threading.Lock()
        self._encoder = event_encoder()
        # (ts, what was taken) -> the batch's payload, on the publisher's thread. Events by default; a device pool's
        # pure-Python listener puts records and sets its own (`tiers/device_index_events.py`), before its first put.
        self.encode_batch: Callable[[float, list[Any]], bytes] = self.encode_events
        # A device pool's records logged in C (`use_log`): then every event goes through it, in order, and the
        # thread takes each batch from it whole; `_pending` carries only flush markers.
        self._log: Any = None
        self._stop = threading.Event()
        self.seq = 0
        self.batches = 0
        self.events = 0  # events sent (before `coalesce`)
        self._taken = 0  # events the thread took from `_pending` (sent, or dropped with a failed batch)
        self._late = 0  # events published after the thread ended (dropped at once)
        self.replays = 0
        self.replay_failed = 0  # replay requests that raised (logged once): the thread answers the next one
        self.busy_s = 0.0  # the thread's CPU time building, encoding and sending batches (`kv_events.busy_ns`)
        self.failed = 0  # batches dropped: encoding or sending raised
        self.dropped = 0  # events in them, and events published after the thread ended
        self._dead = False  # the publisher's thread ended without a stop: publishes are dropped, not kept
        # Test-only seam: the next N batches get an object the encoder cannot encode appended, so that msgspec's
        # own encode raises in the publisher's thread (`tests/tiers/test_kv_event_failures.py`). Never set otherwise.
        self.test_only_poison_batches = 0
        ctx: zmq.Context[Any] = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)  # a slow subscriber loses batches (seq shows the gap), never us
        self._pub.bind(self.pub_endpoint)
        self._replay = ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.setsockopt(zmq.RCVTIMEO, 200)  # how often the replay thread looks at the stop flag
        self._replay.bind(self.replay_endpoint)
        self._threads = [threading.Thread(target=self._pub_main, name="kvproc-kv-events", daemon=True),
                         threading.Thread(target=self._replay_main, name="kvproc-kv-replay", daemon=True)]
        for t in self._threads:
            t.start()

    def use_log(self, log: Any) -> None:
        """Take batches from `log` (a `kvproc.native._native.EventLog`, which a device pool's index appends to), before
        anything is published: `publish` then logs each event there too, so that one stream keeps their order."""
        if self._taken or self._pending:
            raise RuntimeError("use_log: events were published already")
        self._log = log

    @property
    def hurry(self) -> Callable[[], None]:
        """Ask the thread to send what is waiting now (an `EventLog`'s `on_hurry`, at `max_pending` records)."""
        return self._hurry.set

    def publish(self, events: list[Any]) -> None:
        """Queue `events` (in this order, after everything published before; events, or records `encode_batch` takes)
        for the next batch; never blocks (safe under a caller's lock: the pool's, the tier's)."""
        if not events:
            return
        if self._log is not None:
            for e in events:
                self._log.append_event(self._encoder.encode(e))
            return
        self._extend(events)
        if len(self._pending) >= self.max_pending:
            self._hurry.set()

    def _drop(self, item: Any) -> None:
        """`put` once the thread has ended: count, do not keep."""
        self._late += 1
        self.dropped += 1

    def _drop_many(self, events: list[Any]) -> None:
        self._late += len(events)
        self.dropped += len(events)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every batch of events published before this call went out (True); False when `timeout`
        passed, a batch failed meanwhile (`kv_events.failed`) or the thread is gone."""
        done = threading.Event()
        failed = self.failed
        if self._dead:
            return False
        with self._markers_lock:
            self._markers += 1
        self._pending.append(done)
        self._hurry.set()
        if self._dead:  # the thread ended as the marker went in: it may never be taken
            return False
        return done.wait(timeout) and self.failed == failed and not self._dead

    def _take(self) -> tuple[list[Any], list[threading.Event]]:
        """(events, flush markers): everything in `_pending` now; later appends wait for the next batch."""
        q = self._pending
        # Every popleft called from C (starmap over a repeat): no bytecode per item, so the thread does not hold
        # the GIL in Python for a batch's worth of items (1,700 records: 28 us, against 129 us for a loop that pops
        # and sorts each: bench/RESULTS.md, "Eighth session"). A flush marker is looked for only when one is out:
        # `flush` counts it before it appends it, so one taken here is counted by now.
        items: list[Any] = list(itertools.starmap(q.popleft, itertools.repeat((), len(q))))
        if not self._markers:
            return items, []
        events: list[Any] = []
        markers: list[threading.Event] = []
        for item in items:
            (markers if isinstance(item, threading.Event) else events).append(item)
        return events, markers

    def _pub_main(self) -> None:
        unsent = 0  # events taken and not yet sent: what a failure outside a batch would lose
        markers: list[threading.Event] = []
        stopping = False
        tick = min(self.batch_interval_s, TICK_S)
        last = time.monotonic()
        try:
            while True:
                if self._hurry.wait(tick):  # what is published meanwhile joins this batch
                    # Cleared before the take: a hurry set after this is for what the take may not see, and its
                    # marker (appended before the set) is either taken now or wakes the next wait at once.
                    self._hurry.clear()
                elif not (self._stopping or len(self._pending) >= self.max_pending
                          or time.monotonic() - last >= self.batch_interval_s):
                    continue  # a tick within the interval: nothing asked
                stopping = self._stopping
                last = time.monotonic()
                events, markers = self._take()
                self._taken += len(events)
                unsent = len(events)
                if self._log is not None:
                    self._send_log()
                elif events:
                    self._send_or_drop(events)
                unsent = 0
                with self._markers_lock:
                    self._markers -= len(markers)
                for m in markers:
                    m.set()
                markers = []
                if stopping:
                    return
        except BaseException:  # logged and counted: the thread has nobody to raise to
            stopping = False
            log.exception("kv_events_publisher_died", endpoint=self.pub_endpoint)
        finally:
            if not stopping:  # ended on a failure: later publishes must not pile up for it, nor flushes wait
                self._dead = True
                self.put, self._extend = self._drop, self._drop_many
                rest, rest_markers = self._take()
                self._late += len(rest)
                self.dropped += unsent + len(rest)
                if self._log is not None:  # later records are counted there (`stats`), not kept
                    self._log.stop_keeping()
                    lost = self._log.discard()
                    self._late += lost
                    self.dropped += lost
                with self._markers_lock:
                    self._markers -= len(markers) + len(rest_markers)
                for m in markers + rest_markers:
                    m.set()  # its flush answers False (`_dead`)
            # A stop's last batch still reaches the connected subscribers (ZeroMQ documents that LINGER 0 discards
            # what it has not written yet; over ipc:// it was delivered anyway in a test, so this is by the book, not
            # measured); bounded, so a stalled subscriber cannot hold the stop.
            self._pub.close(linger=STOP_LINGER_MS if stopping else 0)

    def _send_or_drop(self, events: list[Any]) -> None:
        seq, n = self.seq, len(events)
        t0 = time.thread_time()
        try:
            if self.test_only_poison_batches > 0:
                self.test_only_poison_batches -= 1
                events = events + [object()]  # msgspec's encode raises on it, for real
            self._send(events)
        except Exception:
            self._failed_batch(seq, n)
        finally:
            self.busy_s += time.thread_time() - t0

    def _send_log(self) -> None:
        """One batch of everything `_log` holds: taken and written in one C call, then kept and sent. A batch with a
        record the log refused (its error) fails as one msgspec cannot encode."""
        seq, n = self.seq, 0
        t0 = time.thread_time()
        try:
            payload, n, error = self._log.take(time.time())
            self._taken += n
            if error is not None:
                raise ValueError(f"a KV-event record could not be encoded: {error}")
            if payload is not None:
                self._keep_and_send(payload, n)
        except Exception:
            self._failed_batch(seq, n)
        finally:
            self.busy_s += time.thread_time() - t0

    def _failed_batch(self, seq: int, n: int) -> None:
        self.failed += 1
        self.dropped += n
        with self._kept_lock:
            if self.seq == seq:  # failed before the batch was kept: skip its seq, so that the gap shows
                self.seq += 1
        if self.failed == 1:  # once: a failure that repeats every interval would flood the log
            log.exception("kv_events_batch_failed", endpoint=self.pub_endpoint, seq=seq, events=n)

    def encode_events(self, ts: float, events: list[Any]) -> bytes:
        """The default `encode_batch`: `events` as one `KVEventBatch`, neighbouring removals coalesced."""
        return self._encoder.encode(KVEventBatch(ts, coalesce(events)))

    def _send(self, events: list[Any]) -> None:
        # Inside the batch's guard: an encode that raises (a record it cannot take) fails its batch
        self._keep_and_send(self.encode_batch(time.time(), events), len(events))

    def _keep_and_send(self, payload: bytes, n: int) -> None:
        seq = self.seq
        with self._kept_lock:
            kept = self._kept
            kept.append((seq, payload))
            self._kept_bytes += len(payload)
            while len(kept) > 1 and (len(kept) > self.replay_batches or self._kept_bytes > self.replay_bytes):
                self._kept_bytes -= len(kept.popleft()[1])  # the oldest go first; the newest stays whatever its size
            self.seq += 1
        pub = self._pub  # three sends: a third of send_multipart's cost for frames this small (pyzmq's checks)
        pub.send(TOPIC, zmq.SNDMORE)
        pub.send(seq.to_bytes(8, "big", signed=True), zmq.SNDMORE)
        pub.send(payload)
        self.batches += 1
        self.events += n

    def _replay_main(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    frames = self._replay.recv_multipart()
                except zmq.Again:
                    continue
                try:
                    self._answer_replay(frames)
                except Exception:  # one bad request must not end replays for every later subscriber
                    self.replay_failed += 1
                    if self.replay_failed == 1:
                        log.exception("kv_events_replay_failed", endpoint=self.replay_endpoint)
        except BaseException:
            log.exception("kv_events_replay_thread_died", endpoint=self.replay_endpoint)
            raise
        finally:
            self._replay.close()

    def _answer_replay(self, frames: list[bytes]) -> None:
        ident = frames[0]
        start = int.from_bytes(frames[-1][:8], "big", signed=True) if len(frames) > 1 and frames[-1] else 0
        with self._kept_lock:
            kept = [(seq, payload) for seq, payload in self._kept if seq >= start]
        for seq, payload in kept:
            self._replay.send_multipart([ident, b"", seq.to_bytes(8, "big", signed=True), payload])
        self._replay.send_multipart([ident, b"", END, b""])
        self.replays += 1

    def close(self) -> None:
        """Stop; what was published before goes out first."""
        self._stop.set()
        self._stopping = True
        self._hurry.set()
        for t in self._threads:
            t.join(5)

    def stats(self) -> dict[str, Any]:
        # events in the deque (or the log): waiting for their batch; once the thread ended, a racing `put`'s (lost)
        waiting = max(0, len(self._pending) - self._markers)
        log_dropped = 0  # a log's records after the thread ended: counted there, never kept
        if self._log is not None:
            waiting += self._log.records
            log_dropped = self._log.dropped
        return {"kv_events.batches": self.batches, "kv_events.events": self.events,
                "kv_events.queued": self._taken + self._late + log_dropped + waiting,
                "kv_events.replays": self.replays, "kv_events.seq": self.seq, "kv_events.failed": self.failed,
                "kv_events.dropped": self.dropped + log_dropped + (waiting if self._dead else 0),
                "kv_events.replay_failed": self.replay_failed,
                "kv_events.busy_ns": int(self.busy_s * 1e9),  # counters are ints: a float breaks the typed Report
                "kv_events.replay_kept": len(self._kept), "kv_events.replay_kept_bytes": self._kept_bytes}
