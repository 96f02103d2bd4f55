"""The compiled device-event log (`EventLog`, `kvproc/native/_kv_events.c`) writes exactly the bytes msgspec writes
for the same index changes given to the pure-Python listener (`DeviceIndexEvents` without C, `DeviceBatchEncoder`),
for any changes; a change it cannot encode never raises on the resolve's path but fails its batch (the publisher then
counts it failed and dropped, as one msgspec cannot encode); and its batch is written without the GIL."""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproc import native
from kvproc.core.hashing import PAD_TOKEN_ID
from kvproc.tiers import device_index_events as die
from kvproc.tiers.device_index_events import DeviceBatchEncoder, DeviceIndexEvents
from kvproc.tiers.kv_events import (
    MEDIUM_DEVICE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    decode_batch,
    event_encoder,
)

N = native._native
needs_native = pytest.mark.skipif(N is None, reason="kvproc.native._native not built")

INT_RANGES = {np.int64: (-2**63, 2**63 - 1), np.uint64: (0, 2**64 - 1), np.int32: (-2**31, 2**31 - 1),
              np.uint16: (0, 2**16 - 1), np.int8: (-128, 127)}


def new_log(page: int) -> Any:
    return N.EventLog(page, MEDIUM_DEVICE, PAD_TOKEN_ID)


@st.composite
def token_source(draw, length: int):
    """A registration's token ids as the pool may get them: an int array of some width, a list, bytes, or unknown."""
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


@st.composite
def changes(draw, page: int):
    """A batch's index changes as the pool reports them: registrations (new positions in runs, token ranges that may
    run past the tokens: a padded tail), removals (neighbours coalesce), and events published as they are."""
    out = []
    for _ in range(draw(st.integers(0, 20))):
        keys = draw(st.lists(st.binary(min_size=0, max_size=draw(st.sampled_from([16, 300]))), max_size=18))
        what = draw(st.sampled_from(["stored", "removed", "removed", "event"]))
        if what == "stored" and keys:
            positions = sorted(draw(st.sets(st.integers(0, len(keys) - 1), min_size=1)))
            first_page = draw(st.integers(0, 3))
            stop = first_page + positions[-1] + 1
            tokens = draw(token_source(stop * page))
            if tokens is not None and draw(st.booleans()) and (type(tokens) is not np.ndarray
                                                               or tokens.dtype.itemsize >= 4):
                cut = draw(st.integers(max(0, stop * page - page - 1), stop * page))  # a short last page: padded
                tokens = tokens[:4 * cut] if type(tokens) is bytes else tokens[:cut]
            parent = draw(st.one_of(st.none(), st.binary(min_size=16, max_size=16)))
            out.append(("stored", keys, positions, tokens, first_page, parent))
        elif what in ("removed", "stored"):
            out.append(("removed", keys))
        else:
            out.append(("event", draw(st.sampled_from([AllBlocksCleared(), BlockStored(keys, None, [], page, None,
                                                                                       MEDIUM_DEVICE)]))))
    return out


class RecordingPublisher:
    """One side of the contract: what the pure-Python listener queues, kept in a list (no socket, no thread)."""

    def __init__(self) -> None:
        self.items: list[Any] = []
        self.put = self.items.append
        self.encode_batch: Any = None

    def publish(self, events: list[Any]) -> None:
        self.items.extend(events)


def python_form(page: int, calls: list, ts: float, monkeypatch: pytest.MonkeyPatch) -> bytes:
    monkeypatch.setattr(die, "NATIVE", None)
    pub = RecordingPublisher()
    listener = DeviceIndexEvents(pub, page)  # type: ignore[arg-type]  # the recording side of the publisher
    monkeypatch.undo()
    for call in calls:
        if call[0] == "event":
            pub.publish([call[1]])
        else:
            getattr(listener, call[0])(*call[1:])
    assert isinstance(pub.encode_batch, DeviceBatchEncoder)
    return pub.encode_batch(ts, pub.items)


def log_form(log: Any, calls: list) -> None:
    enc = event_encoder()
    for call in calls:
        if call[0] == "event":
            log.append_event(enc.encode(call[1]))
        else:
            getattr(log, call[0])(*call[1:])


@needs_native
@settings(max_examples=300, deadline=None)
@given(st.data(), st.sampled_from([1, 3, 16]), st.floats(allow_nan=False))
def test_the_logs_batch_is_msgspecs_bytes_for_any_changes(data, page, ts):
    calls = data.draw(changes(page))
    log = new_log(page)
    log_form(log, calls)
    payload, records, error = log.take(ts)
    assert error is None and records == log.appended
    if not calls:
        assert payload is None and records == 0
        return
    with pytest.MonkeyPatch.context() as mp:
        assert payload == python_form(page, calls, ts, mp)
    decode_batch(payload)  # and a subscriber reads it
    assert log.take(ts) == (None, 0, None)  # taken: the next batch starts empty


@needs_native
def test_the_buffers_are_reused_batch_after_batch():
    """A take swaps the two buffers: what is logged meanwhile is the next batch's, and each batch is its own."""
    log = new_log(4)
    keys = [bytes([i]) * 16 for i in range(8)]
    for r in range(5):
        log.stored(keys, [r], np.arange(40, dtype=np.int64) + r, 0, None)
        log.removed(keys[r:r + 1])
        payload, records, error = log.take(float(r))
        events = decode_batch(payload).events
        assert records == 2 and error is None
        assert [type(e) for e in events] == [BlockStored, BlockRemoved]
        assert events[0].block_hashes == [keys[r]] and events[0].token_ids == list(range(4 * r + r, 4 * r + r + 4))


@needs_native
def test_long_arrays_take_msgpacks_longer_headers():
    """Past 15 and 65,535 items an array's header grows (array16, array32); past 255 bytes a key's (bin16)."""
    keys = [bytes([i % 256]) * 16 for i in range(70_000)]
    calls = [("stored", keys, list(range(70_000)), np.arange(70_000 * 16, dtype=np.int64), 0, None),
             ("removed", [b"k" * 300] * 40_000), ("removed", [b"j" * 16] * 30_000)]
    log = new_log(16)
    log_form(log, calls)
    payload = log.take(1.5)[0]
    with pytest.MonkeyPatch.context() as mp:
        assert payload == python_form(16, calls, 1.5, mp)
    events = decode_batch(payload).events
    assert [type(e) for e in events] == [BlockStored, BlockRemoved]  # the two removals: one event
    assert len(events[0].token_ids) == 70_000 * 16 and len(events[1].block_hashes) == 70_000


@needs_native
def test_what_it_cannot_encode_fails_its_batch_not_the_caller():
    """A change the log cannot encode never raises where the pool reports it (a resolve's path): its batch's take
    answers the error instead of a payload, and the next batch is whole again."""
    h = [b"a" * 16]
    bad = {
        "a key that is not bytes": ("stored", ["text"], [0]),
        "a removed key that is not bytes": ("removed", [b"a" * 16, 7]),
        "removed keys that are no sequence": ("removed", 7),
        "a parent that is not bytes": ("stored", [b"x" * 16], [0], None, 0, "p"),
        "a float token": ("stored", h, [0], [1, 2.5, 3, 4]),
        "a float token array": ("stored", h, [0], np.ones(4)),
        "a token past uint64": ("stored", h, [0], [2**64, 1, 1, 1]),
        "a token below int64": ("stored", h, [0], [-2**63 - 1, 1, 1, 1]),
        "a position past the keys": ("stored", h, [1]),
        "a negative first page": ("stored", h, [0], None, -1),
        "a position that is not an int": ("stored", h, ["0"]),
        "positions that are no sequence": ("stored", h, 0),
        "keys that are no sequence": ("stored", 7, [0]),
    }
    log = new_log(4)
    for what, call in bad.items():
        log.removed(h)
        getattr(log, call[0])(*call[1:])  # does not raise
        log.removed(h)
        payload, records, error = log.take(0.0)
        assert payload is None and records == 3 and isinstance(error, str), what
        log.stored(h, [0], [1, 2, 3, 4])
        payload, records, error = log.take(0.0)
        assert error is None and records == 1 and decode_batch(payload).events[0].token_ids == [1, 2, 3, 4], what
    with pytest.raises(TypeError):
        log.stored(h)  # a call the pool never makes: an argument missing
    with pytest.raises(TypeError):
        log.append_event("not bytes")
    with pytest.raises(ValueError):
        N.EventLog(0, MEDIUM_DEVICE, PAD_TOKEN_ID)
    with pytest.raises(ValueError):
        N.EventLog(4, MEDIUM_DEVICE, -1)  # a pad id that is not a uint32
    bare = N.EventLog.__new__(N.EventLog)  # never initialised: refused, not a crash
    for call in (lambda: bare.stored(h, [0]), lambda: bare.removed(h), lambda: bare.take(0.0),
                 lambda: bare.append_event(b"\xc0")):
        with pytest.raises(RuntimeError, match="not initialised"):
            call()


@needs_native
def test_stop_keeping_counts_and_drops_and_on_hurry_is_called_once_a_batch():
    hurried = []
    log = N.EventLog(4, MEDIUM_DEVICE, PAD_TOKEN_ID, 3, lambda: hurried.append(log.records))
    h = [b"a" * 16]
    for _ in range(5):
        log.removed(h)
    assert hurried == [3]  # at the third record, once
    assert log.take(0.0)[1] == 5
    for _ in range(3):
        log.removed(h)
    assert hurried == [3, 3]  # again in the next batch
    assert log.discard() == 3 and log.records == 0
    log.stop_keeping()
    log.removed(h)
    log.stored(h * 3, [0, 2])  # two runs: two records
    log.append_event(event_encoder().encode(AllBlocksCleared()))
    assert log.dropped == 4 and log.records == 0 and log.take(0.0) == (None, 0, None)


@needs_native
def test_the_take_writes_without_the_gil():
    """The engine's threads run while the publisher's thread writes a batch: seen from a second thread counting the
    moments it ran during the call. The switch interval is raised past the test so that the interpreter never takes
    the GIL from the calling thread on its own (only the C code can let it go). Control: logging the same record
    (an append: C that keeps the GIL) lets the counter run not once."""
    keys = [bytes([i % 256]) * 16 for i in range(1 << 16)]
    tokens = np.arange(1 << 20, dtype=np.int64)  # 1M ids: a write of several ms

    def ran_during(fn) -> int:
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
            fn()
        inside[0] = False
        done.set()
        t.join()
        return seen[0]

    log = new_log(16)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        def log_three() -> None:
            log.stored(keys, range(1 << 16), tokens, 0, None)

        def take_one() -> None:
            log.stored(keys, range(1 << 16), tokens, 0, None)
            assert log.take(0.0)[0] is not None

        assert ran_during(log_three) == 0  # the control: appends hold the GIL
        log.take(0.0)
        assert ran_during(take_one) > 0
    finally:
        sys.setswitchinterval(old)
