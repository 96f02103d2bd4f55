"""A device pool's prefix index as KV events: the listener the pool calls under its lock (`DeviceIndexEvents`), the
records it queues there, and the encoder the publisher's thread turns them into a batch with (`DeviceBatchEncoder`).

Why records and not events: the listener runs on a resolve's path, so it only queues what it was told -- a slice of
the keys, the registration's token array as it is -- and the publisher's thread does the rest. And why an encoder of
its own: with token ids, building each `BlockStored` and encoding it through Python ints cost that thread ~25 us of
CPU per resolve in the engine's process (bench/RESULTS.md, "Seventh session"), where the compiled form
(`kvproc/native/_kv_events.c`) writes the payload straight from the records, the GIL let go while it writes (the
engine's threads run meanwhile). Both forms give the same bytes (tests).

The records, as `put` queues them:

- `(STORED, hashes, parent, tokens, start, stop)`: `BlockStored(list(hashes), parent, page_token_ids(tokens, start,
  stop, block_size), block_size, None, "GPU")`;
- `(REMOVED, hashes)`: `BlockRemoved(list(hashes), "GPU")`; neighbouring ones become one event;
- an event (`attach`'s first ones): encoded as it is.

`hashes` is the keys packed into one bytes object (`kv_pack_keys`: `HASH_BYTES` each, as every hasher makes them), or a
list where a key is of another size (a test's own keys). Why packed: a record holding the keys' own objects keeps
them alive until the thread writes the batch, up to an interval later, when each is a cold allocation of its own, read
and then freed with the GIL held; and the resolve's next allocations cannot reuse their memory meanwhile. The packed
copy is made while they are warm (bench/RESULTS.md, "Ninth session").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvproc.core.hashing import HASH_BYTES, PAD_TOKEN_ID
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


def _pack_keys_python(keys: Sequence[bytes], lo: int, hi: int, width: int) -> bytes | None:
    part = keys[lo:hi]
    return b"".join(part) if all(type(k) is bytes and len(k) == width for k in part) else None


# (keys, lo, hi, width) -> keys[lo:hi] packed, or None when one is not bytes of `width` bytes. Called as it is, not
# through a wrapper, on a resolve's path.
_pack: Any = NATIVE.kv_pack_keys if NATIVE is not None else _pack_keys_python


def _stored_record(hashes: Sequence[bytes], lo: int, hi: int, parent: bytes | None, tokens: Any,
                   first_page: int) -> tuple[Any, ...]:
    """The `STORED` record of the run `hashes[lo:hi]`: its parent is the page before it, `parent` at the prompt's
    first page."""
    keys = _pack(hashes, lo, hi, HASH_BYTES)
    return (STORED, hashes[lo:hi] if keys is None else keys, hashes[lo - 1] if lo else parent, tokens,
            first_page + lo, first_page + hi)


def unpack_keys(keys: bytes | Sequence[bytes]) -> list[bytes]:
    """A record's keys as a list (the packing's inverse)."""
    if not isinstance(keys, bytes):
        return list(keys)
    if len(keys) % HASH_BYTES:
        raise ValueError(f"packed block hashes: {len(keys)} bytes are not keys of {HASH_BYTES} bytes")
    return [keys[i:i + HASH_BYTES] for i in range(0, len(keys), HASH_BYTES)]


class DeviceBatchEncoder:
    """`KvEventPublisher.encode_batch` for a device pool's records: the compiled form where it is built, else
    `python` (the same bytes)."""

    def __init__(self, block_size: int, medium: str = MEDIUM_DEVICE) -> None:
        self.encode_event = event_encoder().encode  # one event's bytes (the compiled form's fallback)
        self.block_size = block_size
        self.medium = medium

    def __call__(self, ts: float, items: list[Any]) -> bytes:
        if NATIVE is None:
            return self.python(ts, items)
        return NATIVE.kv_device_batch(ts, items, self.block_size, self.medium, PAD_TOKEN_ID, self.encode_event, True,
                                      HASH_BYTES)

    def python(self, ts: float, items: list[Any]) -> bytes:
        """The pure-Python form: each record built into its event, then msgspec."""
        return self.encode_event(KVEventBatch(ts, coalesce([self.build(e) for e in items])))

    def build(self, item: Any) -> KvEvent:
        if type(item) is not tuple:
            return item
        P = self.block_size
        if item[0] == STORED and len(item) == 6:
            _, hashes, parent, tokens, start, stop = item
            return BlockStored(unpack_keys(hashes), parent, page_token_ids(tokens, start, stop, P), P, None,
                               self.medium)
        if item[0] == REMOVED and len(item) == 2:
            return BlockRemoved(unpack_keys(item[1]), self.medium)
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
    batch on. Sets `publisher.encode_batch`: the publisher is this listener's alone."""

    def __init__(self, publisher: KvEventPublisher, block_size: int) -> None:
        self.publisher = publisher
        self.block_size = block_size
        publisher.encode_batch = DeviceBatchEncoder(block_size)

    def attach(self, pool: Any) -> None:
        """Start publishing `pool`'s (a `core.pool.BlockPool`) index changes."""
        with pool.lock:
            keys = list(pool.paged.index)
            events: list[KvEvent] = [AllBlocksCleared()]
            if keys:
                events.append(BlockStored(keys, None, [], self.block_size, None, MEDIUM_DEVICE))
            self.publisher.publish(events)
            pool.paged.listener = self

    @staticmethod
    def detach(pool: Any) -> None:
        with pool.lock:
            pool.paged.listener = None

    def stored(self, hashes: Sequence[bytes], positions: list[int], tokens: Any = None, first_page: int = 0,
               parent: bytes | None = None) -> None:
        # Under the pool's lock on a resolve's path: only the keys are copied, packed (the caller may reuse its list);
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
        keys = _pack(hashes, 0, len(hashes), HASH_BYTES)
        self.publisher.put((REMOVED, hashes if keys is None else keys))  # `hashes`: a list made for this call
