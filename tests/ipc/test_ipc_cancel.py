"""Cancel tokens and the per-process registry (no processes needed)."""

from __future__ import annotations

import pytest

from kvproc.ipc.cancel import CancelRegistry, CancelToken
from kvproc.ipc.errors import CallCancelled


def test_cancel_fires_listeners_once_so_onward_calls_are_cancelled_too() -> None:
    reg = CancelRegistry()
    token = reg.acquire(42)
    forwarded: list[int] = []
    assert token.add_listener(forwarded.append)  # e.g. a client forwarding Cancel to the next process
    assert reg.cancel(42) is True
    reg.cancel(42)
    assert forwarded == [42] and token.cancelled
    with pytest.raises(CallCancelled):
        token.check()


def test_cancel_that_overtakes_its_call_is_remembered() -> None:
    reg = CancelRegistry()
    assert reg.cancel(7) is False
    assert reg.acquire(7).cancelled


def test_calls_under_one_token_share_it_until_the_last_releases() -> None:
    reg = CancelRegistry()
    a, b = reg.acquire(9), reg.acquire(9)
    assert a is b
    reg.release(a)
    assert reg.live_count() == 1
    reg.release(b)
    assert reg.live_count() == 0


def test_listener_added_after_cancel_is_refused_so_the_caller_sends_cancel_itself() -> None:
    token = CancelToken()
    token.cancel()
    assert token.add_listener(lambda _: None) is False
    assert token.wait(0) is True


def test_remembered_ids_are_bounded() -> None:
    reg = CancelRegistry(remember=3)
    for i in range(10):
        reg.cancel(i)
    assert not reg.acquire(0).cancelled and reg.acquire(9).cancelled
