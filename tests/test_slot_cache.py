"""`SlotCache`: bounded, newest-learned kept, a run stops at the first unknown page, skips unreserved slots."""

from __future__ import annotations

import threading

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproc.tiers.slot_cache import SlotCache


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_run_is_the_leading_known_pages_only() -> None:
    c = SlotCache(10)
    c.learn([k(0), k(1), k(3)], [5, 6, 8], [1, 1, 2])
    assert c.run([k(0), k(1), k(2), k(3)]) == ([5, 6], [1, 1])
    assert c.run([k(2), k(0)]) == ([], [])
    c.forget([k(1)])
    assert c.run([k(0), k(1)]) == ([5], [1])


def test_pages_without_a_slot_or_generation_are_not_learned() -> None:
    c = SlotCache(10)
    c.learn([k(0), k(1), k(2)], [None, 4, 5], [None, 2, None])  # a deduplicated page has no slot in a ticket
    assert len(c) == 1 and c.run([k(1)]) == ([4], [2])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(0, 40), max_size=200), st.integers(1, 16))
def test_bounded_and_the_newest_learned_win(keys, capacity) -> None:  # type: ignore[no-untyped-def]
    c = SlotCache(capacity)
    for n, i in enumerate(keys):
        c.learn([k(i)], [i], [n])
    assert len(c) <= capacity
    newest = list(dict.fromkeys(reversed(keys)))[:capacity]  # distinct keys, most recently learned first
    for i in newest:
        assert c.run([k(i)]) == ([i], [max(n for n, j in enumerate(keys) if j == i)])


def test_concurrent_learners_and_readers_keep_it_bounded() -> None:
    c = SlotCache(64)
    errors: list[BaseException] = []

    def work(base: int) -> None:
        try:
            for i in range(2000):
                c.learn([k(base + i % 100)], [i], [i])
                c.run([k(base + j) for j in range(10)])
                if i % 7 == 0:
                    c.forget([k(base + i % 100)])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(1000 * t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(c) <= 64


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError):
        SlotCache(0)
