"""KV events: what a host tier stores and removes, published for KV-aware routers (llm-d, Dynamo, SGLang's router).

The events have the shape of vLLM's own (`KVEventBatch` of `BlockStored` / `BlockRemoved` / `AllBlocksCleared`,
msgspec msgpack, array-like, tagged), so a router that reads vLLM's stream reads this one:

- `BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium)`: pages committed, one event per
  run of consecutive new pages of one save; `parent_block_hash` is the page before the run in that save (None at the
  save's first page: the tier never sees the chain before it); `token_ids` is empty (the tier keeps hashes only);
  `medium` is "cpu";
- `BlockRemoved(block_hashes, medium)`: pages evicted;
- `AllBlocksCleared()`: the first batch of a tier incarnation (a subscriber drops what an earlier one held).

Transport (vLLM's convention): a ZeroMQ PUB socket sends `[topic, seq (8 bytes, big-endian), payload]` per batch;
`seq` grows by one per batch, so a gap is visible. A ROUTER socket beside it answers a replay request (the 8-byte
start seq) with every kept batch from there, `[seq, payload]` each, then `[-1, b""]`. The last `replay_batches`
batches are kept. Endpoints: `ipc://<runtime dir>/kv-events-<rank>` and `.../kv-events-replay-<rank>`
(`endpoints()`). Off unless the tier is started with `kv_events` (`ClusterStore.start(kv_events=True)`, `kvproc up
--kv-events`).
"""

from __future__ import annotations

import collections
import os
import queue
import threading
import time
from typing import Any, Union

import msgspec
import zmq

MEDIUM = "cpu"
TOPIC = b"kv-events"
END = (-1).to_bytes(8, "big", signed=True)


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


def endpoints(runtime_dir: str, rank: int) -> tuple[str, str]:
    """(PUB endpoint, replay endpoint) of rank `rank`'s host tier."""
    return (f"ipc://{os.path.join(runtime_dir, f'kv-events-{rank}')}",
            f"ipc://{os.path.join(runtime_dir, f'kv-events-replay-{rank}')}")


def coalesce(events: list[KvEvent]) -> list[KvEvent]:
    """Neighbouring removals become one event (evictions come a page at a time)."""
    out: list[KvEvent] = []
    for e in events:
        if isinstance(e, BlockRemoved) and out and isinstance(out[-1], BlockRemoved):
            out[-1] = BlockRemoved(out[-1].block_hashes + e.block_hashes)
        else:
            out.append(e)
    return out


class KvEventPublisher:
    """Publishes batches on its own thread (ZeroMQ sockets belong to one thread); `publish` only enqueues."""

    def __init__(self, runtime_dir: str, rank: int, replay_batches: int = 10_000) -> None:
        self.pub_endpoint, self.replay_endpoint = endpoints(runtime_dir, rank)
        self._queue: queue.SimpleQueue[list[KvEvent] | None] = queue.SimpleQueue()
        self._kept: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=replay_batches)
        self._encoder = msgspec.msgpack.Encoder()
        self.seq = 0
        self.batches = 0
        self.events = 0
        self.replays = 0
        ctx: zmq.Context[Any] = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)  # a slow subscriber loses batches (seq shows the gap), never us
        self._pub.bind(self.pub_endpoint)
        self._replay = ctx.socket(zmq.ROUTER)
        self._replay.setsockopt(zmq.LINGER, 0)
        self._replay.bind(self.replay_endpoint)
        self._thread = threading.Thread(target=self._main, name="kvproc-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KvEvent]) -> None:
        if events:
            self._queue.put(events)

    def _send(self, events: list[KvEvent]) -> None:
        payload = self._encoder.encode(KVEventBatch(time.time(), coalesce(events)))
        seq = self.seq
        self.seq += 1
        self._kept.append((seq, payload))
        self._pub.send_multipart([TOPIC, seq.to_bytes(8, "big", signed=True), payload])
        self.batches += 1
        self.events += len(events)

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        ident, start = frames[0], int.from_bytes(frames[-1][:8], "big", signed=True) if frames[-1] else 0
        for seq, payload in list(self._kept):
            if seq >= start:
                self._replay.send_multipart([ident, b"", seq.to_bytes(8, "big", signed=True), payload])
        self._replay.send_multipart([ident, b"", END, b""])
        self.replays += 1

    def _main(self) -> None:
        poller = zmq.Poller()
        poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                if poller.poll(5):  # replay requests, between batches
                    self._answer_replay()
                try:
                    while True:
                        item = self._queue.get_nowait()
                        if item is None:
                            return
                        self._send(item)
                except queue.Empty:
                    pass
        finally:
            self._pub.close()
            self._replay.close()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(5)

    def stats(self) -> dict[str, Any]:
        return {"kv_events.batches": self.batches, "kv_events.events": self.events, "kv_events.replays": self.replays,
                "kv_events.seq": self.seq}
