"""kvproc's host-tier KV events inside vLLM's own event stream (`KvprocConnector.take_events`).

Why: a KV-aware router (llm-d's, Dynamo's) subscribes to each engine's vLLM KV-event endpoint
(`--kv-events-config`). kvproc's host tier publishes on an endpoint of its own, which such a router does not know
of; forwarded, the pages an engine can restore from its host tier reach the router with the engine's GPU blocks, on
the endpoint it already reads, as vLLM's own connectors' events do (vLLM's scheduler publishes whatever its
connector's `take_events` yields, in the same batch as its own).

What goes through: each `BlockStored` (medium "CPU", kvproc's page hashes, the token ids when the tier carries them:
`kv_events_tokens`) and `BlockRemoved`, in the tier's order. Not `AllBlocksCleared`: the tier's comes only as the
first batch of its incarnation (it is not restarted), before any page of it; forwarded, it would tell a router that
this engine's GPU blocks are gone too.

How: a SUB socket on the tier's endpoint, read without blocking at each `take` (each scheduler step: no thread of
its own in vLLM's busy process); at start, what the tier published before is read from its replay endpoint (a
shared tier's pages of other engines are restorable here too), and batches are told apart by their seq, so none is
forwarded twice. A seq that jumps (batches dropped by a full socket: an engine idle for a very long time) is counted
(`gaps`) and logged once; the pages in the batches missed stay unknown to the router until they change again.
"""

from __future__ import annotations

from typing import Any

import structlog
import zmq

from kvproc.tiers.kv_events import TOPIC, AllBlocksCleared, BlockRemoved, BlockStored, decode_batch, read_replay

log = structlog.get_logger(__name__)

RCVHWM = 100_000  # batches the socket keeps between two takes (~80 min of 50 ms batches)
REPLAY_TIMEOUT_MS = 2000  # the start-up replay's per-frame wait: a tier that does not answer does not hold vLLM
# One take's bound, so that a step after a long idle does not decode the whole backlog at once (the rest waits for
# the next steps; the tier sends one batch per 50 ms, a step comes every few ms to tens of ms).
MAX_BATCHES_PER_TAKE = 64


class TierEventForwarder:
    """Reads one host tier's KV events and hands them out as vLLM's `KVCacheEvent`s."""

    def __init__(self, pub_endpoint: str, replay_endpoint: str) -> None:
        from vllm.distributed import kv_events as vk  # only in vLLM's environment

        self._vk = vk
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, RCVHWM)
        self._sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._sub.connect(pub_endpoint)  # before the replay: a batch sent meanwhile is in one or the other
        self._next = 0  # the seq of the next batch to forward
        self.forwarded = 0  # events handed to vLLM
        self.batches = 0
        self.gaps = 0  # seq jumps: batches never seen
        self.replayed = 0  # batches read from the replay at start
        self._pending: list[Any] = []
        try:
            self._catch_up(replay_endpoint)
        except BaseException:
            self._sub.close(linger=0)
            raise

    def _catch_up(self, replay_endpoint: str) -> None:
        try:
            for seq, payload in read_replay(replay_endpoint, 0, REPLAY_TIMEOUT_MS):
                self._batch(seq, payload)
                self.replayed += 1
        except TimeoutError:
            log.warning("kv_event_forward_replay_timed_out", endpoint=replay_endpoint, batches=self.replayed)

    def take(self) -> list[Any]:
        """The events published since the last take, converted, in order (never blocks)."""
        sub = self._sub
        for _ in range(MAX_BATCHES_PER_TAKE):
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) == 3 and frames[0] == TOPIC:
                self._batch(int.from_bytes(frames[1], "big", signed=True), frames[2])
        out, self._pending = self._pending, []
        self.forwarded += len(out)
        return out

    def _batch(self, seq: int, payload: bytes) -> None:
        if seq < self._next:  # already forwarded (the replay and the live stream overlap)
            return
        if seq > self._next:
            self.gaps += 1
            if self.gaps == 1:
                log.warning("kv_event_forward_gap", expected=self._next, got=seq)
        self._next = seq + 1
        self.batches += 1
        vk = self._vk
        for e in decode_batch(payload).events:
            if isinstance(e, BlockStored):
                self._pending.append(vk.BlockStored(
                    block_hashes=e.block_hashes, parent_block_hash=e.parent_block_hash, token_ids=e.token_ids,
                    block_size=e.block_size, lora_id=e.lora_id, medium=e.medium, lora_name=None))
            elif isinstance(e, BlockRemoved):
                self._pending.append(vk.BlockRemoved(block_hashes=e.block_hashes, medium=e.medium))
            elif not isinstance(e, AllBlocksCleared):  # pragma: no cover - the tier publishes these three only
                log.warning("kv_event_forward_unknown_event", type=type(e).__name__)

    def stats(self) -> dict[str, int]:
        return {"kv_events_forwarded": self.forwarded, "kv_events_forward_batches": self.batches,
                "kv_events_forward_gaps": self.gaps, "kv_events_forward_replayed": self.replayed}

    def close(self) -> None:
        self._sub.close(linger=0)
