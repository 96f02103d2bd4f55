"""The compiled device-event batch encoder (`kvproc/native/_kv_events.c`) writes exactly the bytes msgspec writes for
the same records built into events (`DeviceBatchEncoder.python`), for any records, and rejects what it cannot encode
with an error (the publisher then fails that batch, as it fails one msgspec cannot encode)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproc import native
from kvproc.core.hashing import PAD_TOKEN_ID
from kvproc.tiers.device_index_events import REMOVED, STORED, DeviceBatchEncoder
from kvproc.tiers.kv_events import (
    MEDIUM_DEVICE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
)

N = native._native
needs_native = pytest.mark.skipif(N is None, reason="kvproc.native._native not built")


def compiled(enc: DeviceBatchEncoder, ts: float, items: list) -> bytes:
    return N.kv_device_batch(ts, items, enc.block_size, enc.medium, PAD_TOKEN_ID, enc.encode_event)


INT_RANGES = {np.int64: (-2**63, 2**63 - 1), np.uint64: (0, 2**64 - 1), np.int32: (-2**31, 2**31 - 1),
              np.uint16: (0, 2**16 - 1), np.int8: (-128, 127)}


@st.composite
def token_source(draw, length: int):
    """A registration's token ids as the pool may get them: an int array of some width, a list, or unknown."""
    kind = draw(st.sampled_from(["none", "list", "packed", *INT_RANGES]))
    if kind == "none":
        return None
    if kind == "packed":  # a prompt's ids as its hash packed them (`PageHashes.data`): little-endian uint32
        edges = st.sampled_from([0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1])  # each msgpack form's ends
        ids = st.lists(st.one_of(edges, st.integers(0, 2**32 - 1)), min_size=length, max_size=length)
        return np.array(draw(ids), "<u4").tobytes()
    if kind == "list":  # msgpack's whole int range: int64's negatives, uint64's top
        return draw(st.lists(st.integers(-2**63, 2**64 - 1), min_size=length, max_size=length))
    lo, hi = INT_RANGES[kind]
    # Values near every msgpack size boundary, and anything in the dtype's range
    edges = [v for v in (0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, -1, -32, -33, -128, -129, -32768,
                         -32769, -2**31, -2**31 - 1, lo, hi) if lo <= v <= hi]
    vals = draw(st.lists(st.one_of(st.sampled_from(edges), st.integers(lo, hi)), min_size=length, max_size=length))
    return np.array(vals, dtype=kind)


def pack(draw, keys: list) -> object:
    """A record's keys as the listener may queue them: packed (`kv_pack_keys`) where every key is 16 bytes, else a
    list or a tuple."""
    form = draw(st.sampled_from(["packed", "list", "tuple"]))
    if form == "packed" and all(len(k) == 16 for k in keys):
        packed = N.kv_pack_keys(keys, 0, len(keys), 16)
        assert packed == b"".join(keys)
        return packed
    return keys if form == "list" else tuple(keys)


@st.composite
def records(draw, page: int):
    """A batch's records: stored runs (token ranges that may run past the tokens: a padded tail), removals (runs of
    them coalesce), and events queued as they are."""
    out = []
    for _ in range(draw(st.integers(0, 20))):
        keys = draw(st.lists(st.binary(min_size=0, max_size=draw(st.sampled_from([16, 300]))), max_size=18))
        what = draw(st.sampled_from(["stored", "removed", "removed", "event"]))
        if what == "stored":
            start = draw(st.integers(0, 4))
            stop = start + draw(st.integers(0, 5))
            # Past the end of the tokens: a padded tail (in a dtype that holds the pad id, as a prompt's ids do)
            tokens = draw(token_source(stop * page))
            if tokens is not None and draw(st.booleans()) and (type(tokens) is not np.ndarray
                                                               or tokens.dtype.itemsize >= 4):
                cut = draw(st.integers(max(0, stop * page - page - 1), stop * page))
                tokens = tokens[:4 * cut] if type(tokens) is bytes else tokens[:cut]
            parent = draw(st.one_of(st.none(), st.binary(min_size=16, max_size=16)))
            out.append((STORED, pack(draw, keys), parent, tokens, start, stop))
        elif what == "removed":
            out.append((REMOVED, pack(draw, keys)))
        else:
            out.append(draw(st.sampled_from([AllBlocksCleared(), BlockStored(keys, None, [], page, None,
                                                                                 MEDIUM_DEVICE)])))
    return out


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from([1, 3, 16]), st.floats(allow_nan=False))
def test_the_compiled_batch_is_msgspecs_bytes_for_any_records(data, page, ts):
    enc = DeviceBatchEncoder(page)
    items = data.draw(records(page))
    got = compiled(enc, ts, items)
    assert got == enc.python(ts, items)
    decode_batch(got)  # and a subscriber reads it


@needs_native
def test_long_arrays_take_msgpacks_longer_headers():
    """Past 15 and 65,535 items an array's header grows (array16, array32); past 255 bytes a key's (bin16)."""
    enc = DeviceBatchEncoder(16)
    tokens = np.arange(70_000 * 16, dtype=np.int64)
    items = [(STORED, [bytes([i % 256]) * 16 for i in range(70_000)], None, tokens, 0, 70_000),
             (REMOVED, [b"k" * 300] * 40_000), (REMOVED, [b"j" * 16] * 30_000)]
    got = compiled(enc, 1.5, items)
    assert got == enc.python(1.5, items)
    events = decode_batch(got).events
    assert [type(e) for e in events] == [BlockStored, BlockRemoved]  # the two removals: one event
    assert len(events[0].token_ids) == 70_000 * 16 and len(events[1].block_hashes) == 70_000


@needs_native
def test_what_it_cannot_encode_raises():
    enc = DeviceBatchEncoder(4)
    h = [b"a" * 16]
    bad = {
        "a key that is not bytes": [(STORED, ["text"], None, None, 0, 1)],
        "a removed key that is not bytes": [(REMOVED, [b"a" * 16, 7])],
        "a parent that is not bytes": [(STORED, h, "p", None, 0, 1)],
        "a float token": [(STORED, h, None, [1, 2.5, 3, 4], 0, 1)],
        "a float token array": [(STORED, h, None, np.ones(4), 0, 1)],
        "a token past uint64": [(STORED, h, None, [2**64, 1, 1, 1], 0, 1)],
        "a token below int64": [(STORED, h, None, [-2**63 - 1, 1, 1, 1], 0, 1)],
        "a bad page range": [(STORED, h, None, None, 2, 1)],
        "a negative start": [(STORED, h, None, None, -1, 1)],
        "an object msgspec cannot encode": [object()],
        "a tuple of no record's kind": [(5, h)],
        "a stored record of the wrong arity": [(STORED, h, None)],
        "a removed record of the wrong arity": [(REMOVED, h, None)],
        "packed keys that are not 16 bytes each": [(REMOVED, b"a" * 17)],
    }
    for what, items in bad.items():
        with pytest.raises((TypeError, ValueError, OverflowError, NotImplementedError)):
            compiled(enc, 0.0, items)
            pytest.fail(what)
    assert N.kv_pack_keys([b"a" * 16, b"b"], 0, 2, 16) is None  # a key of another size: queued as a list
    with pytest.raises(ValueError):
        N.kv_pack_keys([b"a" * 16], 0, 2, 16)
    with pytest.raises(TypeError, match="must return bytes"):
        N.kv_device_batch(0.0, [object()], 4, MEDIUM_DEVICE, PAD_TOKEN_ID, lambda e: "not bytes")
    with pytest.raises(ValueError):
        N.kv_device_batch(0.0, [], 0, MEDIUM_DEVICE, PAD_TOKEN_ID, enc.encode_event)


@needs_native
def test_the_write_lets_the_gil_go_unless_a_records_ids_are_python_ints():
    """The engine's threads run while the publisher's thread writes a batch from memory (its keys, packed or array
    token ids): that write holds no GIL. Ids given as a list of Python ints are read with it. Seen from a second
    thread counting the moments it ran while the encode was under way; the switch interval is raised for the test so
    that the interpreter never takes the GIL from the encoding thread on its own (only the C code can let it go)."""
    import sys
    import threading
    import time

    enc = DeviceBatchEncoder(16)
    packed = np.arange(1 << 20, dtype="<u4").tobytes()  # 1M ids: a write of several ms
    keys = [bytes([i % 256]) * 16 for i in range(1 << 16)]

    def ran_during(tokens, release: bool) -> int:
        inside, seen, done = [False], [0], threading.Event()

        def count() -> None:
            while not done.is_set():
                seen[0] += inside[0]
                time.sleep(0.0002)

        t = threading.Thread(target=count)
        t.start()
        time.sleep(0.01)  # it runs
        inside[0] = True
        for _ in range(3):
            N.kv_device_batch(0.0, [(STORED, keys, None, tokens, 0, 1 << 16)], 16, MEDIUM_DEVICE, PAD_TOKEN_ID,
                              enc.encode_event, release)
        inside[0] = False
        done.set()
        t.join()
        return seen[0]

    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        assert ran_during(packed, True) > 0
        assert ran_during(np.frombuffer(packed, "<u4").astype(np.int64), True) > 0
        # controls: the GIL held throughout (the bench's baseline), and ids that are Python ints
        assert ran_during(packed, False) == 0
        assert ran_during(np.frombuffer(packed, "<u4")[: 1 << 20].tolist(), True) == 0
    finally:
        sys.setswitchinterval(old)
