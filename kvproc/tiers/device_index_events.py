"""A device pool's prefix index as KV events: the listener the pool calls under its lock (`DeviceIndexEvents`) and what
turns the changes into a batch on the publisher's thread.

Where the compiled helpers are built (the usual case) the pool's listener is `kvproc.native._native.EventLog`: each
change is appended in C to a byte log, the keys already in their msgpack form and the token ids copied raw, and the
publisher's thread writes a whole batch's msgpack from that log in one call without the GIL (`_kv_events.c` says
why: no Python object is made or freed per record; bench/RESULTS.md, "Twelfth session", measures it against the
queued records it replaced). Elsewhere (`KVPROC_PURE_PYTHON=1`, no C compiler) this module's records go on the
publisher's queue and `DeviceBatchEncoder` builds them into events for msgspec: the same bytes (tests).

The records, as the pure-Python listener queues them:

- `(STORED, hashes, parent, tokens, start, stop)`: `BlockStored(list(hashes), parent, page_token_ids(tokens, start,
  stop, block_size), block_size, None, "GPU")`;
- `(REMOVED, hashes)`: `BlockRemoved(list(hashes), "GPU")`; neighbouring ones become one event;
- an event (`attach`'s first ones): encoded as it is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvproc.core.hashing import PAD_TOKEN_ID
from kvproc.native import NATIVE
from kvproc.tiers.kv_events import (
    MEDIUM_DEVICE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEvent,
    KVEventBatch,
    KvEventPublisher,
    coalesce,
    event_encoder,
    page_token_ids,
)

STORED, REMOVED = 0, 1


def _stored_record(hashes: Sequence[bytes], lo: int, hi: int, parent: bytes | None, tokens: Any,
                   first_page: int) -> tuple[Any, ...]:
    """The `STORED` record of the run `hashes[lo:hi]`: its parent is the page before it, `parent` at the prompt's
    first page."""
    return (STORED, list(hashes[lo:hi]), hashes[lo - 1] if lo else parent, tokens, first_page + lo, first_page + hi)


class DeviceBatchEncoder:
    """`KvEventPublisher.encode_batch` for the pure-Python listener's records: each built into its event, then
    msgspec."""

    def __init__(self, block_size: int, medium: str = MEDIUM_DEVICE) -> None:
        self.encode_event = event_encoder().encode
        self.block_size = block_size
        self.medium = medium

    def __call__(self, ts: float, items: list[Any]) -> bytes:
        return self.encode_event(KVEventBatch(ts, coalesce([self.build(e) for e in items])))

    def build(self, item: Any) -> KvEvent:
        if type(item) is not tuple:
            return item
        P = self.block_size
        if item[0] == STORED and len(item) == 6:
            _, hashes, parent, tokens, start, stop = item
            return BlockStored(list(hashes), parent, page_token_ids(tokens, start, stop, P), P, None,
                               self.medium)
        if item[0] == REMOVED and len(item) == 2:
            return BlockRemoved(list(item[1]), self.medium)
        raise TypeError(f"not a device-event record: a tuple of {len(item)}, kind {item[0] if item else None!r:.20}")


class DeviceIndexEvents:
    """A device pool's prefix index as KV events (`core.paged.IndexListener`): told of each change under the pool's
    lock, so the batches follow the index's own order. `BlockStored` is one event per run of consecutive new keys of
    one registration (parent: the prompt's page before the run, None only at the prompt's first page: a registration
    that starts mid-prompt, a restore after a device hit or pages computed after a prefix, names the page before
    it); a key already indexed (a re-registered page, a duplicate computed twice) is no event, and neither is the
    eviction of a block that no longer owns its key (a displaced duplicate). `token_ids` are the pages' tokens where
    the registration knew them (a computed page: its request's; a page restored by the store's resolve: the
    prompt's), else empty (`attach`'s first event, a bare `PagedBlocks.register`). `attach` starts the stream with
    `AllBlocksCleared` and the keys the index holds already, so a subscriber's set is the index's from the first
    batch on. Takes the publisher for itself (`use_log`, or its `encode_batch`)."""

    def __init__(self, publisher: KvEventPublisher, block_size: int) -> None:
        self.publisher = publisher
        self.block_size = block_size
        # Where C is built, the pool's listener is the compiled log itself (`EventLog`: the records appended in C,
        # each batch taken and written in one call); else this object, queueing records for `DeviceBatchEncoder`.
        self.log: Any = None
        if NATIVE is not None:
            self.log = NATIVE.EventLog(block_size, MEDIUM_DEVICE, PAD_TOKEN_ID, publisher.max_pending,
                                       publisher.hurry)
            publisher.use_log(self.log)
        else:
            publisher.encode_batch = DeviceBatchEncoder(block_size)

    def attach(self, pool: Any) -> None:
        """Start publishing `pool`'s (a `core.pool.BlockPool`) index changes."""
        with pool.lock:
            keys = list(pool.paged.index)
            events: list[KvEvent] = [AllBlocksCleared()]
            if keys:
                events.append(BlockStored(keys, None, [], self.block_size, None, MEDIUM_DEVICE))
            self.publisher.publish(events)
            pool.paged.listener = self if self.log is None else self.log

    @staticmethod
    def detach(pool: Any) -> None:
        with pool.lock:
            pool.paged.listener = None

    def stored(self, hashes: Sequence[bytes], positions: list[int], tokens: Any = None, first_page: int = 0,
               parent: bytes | None = None) -> None:
        if self.log is not None:  # the pool calls the log itself; this is for a caller holding this object
            self.log.stored(hashes, positions, tokens, first_page, parent)
            return
        # Under the pool's lock on a resolve's path: only the keys' list is copied (the caller may reuse it);
        # `tokens` never change (`IndexListener.stored`), so their pages are read by the publisher's thread.
        first, last = positions[0], positions[-1]
        if last - first == len(positions) - 1:  # one run (the usual case: a prefill's new pages): no loop
            self.publisher.put(_stored_record(hashes, first, last + 1, parent, tokens, first_page))
            return
        records: list[Any] = []
        start = prev = positions[0]
        for p in positions[1:] + [-1]:  # -1 closes the last run
            if p != prev + 1:
                records.append(_stored_record(hashes, start, prev + 1, parent, tokens, first_page))
                start = p
            prev = p
        self.publisher.publish(records)

    def removed(self, hashes: list[bytes]) -> None:
        if self.log is not None:
            self.log.removed(hashes)
            return
        self.publisher.put((REMOVED, hashes))  # a list made for this call
