"""`EventCache` (kvproc/ipc/cuda_ipc.py): the copy worker's opened engine events, by handle. Its bookkeeping runs
here with a stub opener (one side of the contract: the CUDA call `open_event` is what it stands for, never run)."""

from __future__ import annotations

import threading
import time

import pytest

from kvproc.ipc.cuda_ipc import EVENT_HANDLE_BYTES, CudaIpcError, EventCache


def _handle(i: int) -> bytes:
    return bytes([i]) * EVENT_HANDLE_BYTES


class _OpenerStub:
    """Stands for `open_event`: returns a fresh object per call and remembers what it was asked."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.calls: list[tuple[bytes, int]] = []
        self.delay_s = delay_s  # an open that takes a while (as a CUDA call may): widens any race

    def __call__(self, handle: bytes, device: int) -> object:
        self.calls.append((handle, device))
        time.sleep(self.delay_s)
        return object()


def test_each_handle_is_opened_once_on_the_bound_device_while_it_is_kept() -> None:
    opener = _OpenerStub()
    cache = EventCache(3, capacity=4, opener=opener)
    ring = [_handle(i) for i in range(4)]  # an engine's ring of 4 events, over and over
    first = [cache.get(h) for h in ring]
    for _ in range(5):
        assert [cache.get(h) for h in ring] == first  # the same opened event each time
    assert opener.calls == [(h, 3) for h in ring] and cache.opened == 4


def test_the_least_recently_used_handle_is_dropped_past_capacity() -> None:
    opener = _OpenerStub()
    cache = EventCache(0, capacity=2, opener=opener)
    a, b, c = _handle(1), _handle(2), _handle(3)
    ev_a = cache.get(a)
    cache.get(b)
    assert cache.get(a) is ev_a  # a is now the most recent
    cache.get(c)  # b goes
    assert len(cache) == 2 and cache.get(a) is ev_a and cache.opened == 3
    cache.get(b)  # opened again
    assert cache.opened == 4 and [h for h, _ in opener.calls] == [a, b, c, b]


def test_a_handle_of_the_wrong_size_is_refused_before_anything_is_opened() -> None:
    opener = _OpenerStub()
    cache = EventCache(0, opener=opener)
    with pytest.raises(CudaIpcError, match="64 bytes"):
        cache.get(b"\x01" * 63)
    assert opener.calls == [] and len(cache) == 0


def test_concurrent_orders_open_a_handle_once() -> None:
    opener = _OpenerStub(delay_s=0.05)
    cache = EventCache(0, opener=opener)
    got: list[object] = []
    barrier = threading.Barrier(8)

    def order() -> None:
        barrier.wait()
        got.append(cache.get(_handle(7)))

    threads = [threading.Thread(target=order) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert len(got) == 8 and len({id(e) for e in got}) == 1 and cache.opened == 1
