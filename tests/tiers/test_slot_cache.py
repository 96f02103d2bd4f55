"""`SlotCache`: bounded, newest-learned kept, a run stops at the first unknown page, skips unreserved slots; the
compiled table (`kvproc.native._native.SlotMap`) behaves exactly as the dict form, op by op."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproc.native import NATIVE
from kvproc.tiers.slot_cache import SlotCache
from tests.hypothesis_budget import examples


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


@settings(max_examples=examples(50), deadline=None)
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


class _DictModel:
    """The semantics, written the plainest way: a dict in learn order, the oldest entries dropped past capacity."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.d = capacity, {}  # type: ignore[var-annotated]

    def learn(self, keys, slots, gens) -> None:  # type: ignore[no-untyped-def]
        for key, s, g in zip(keys, slots, gens):
            if s is not None and g is not None:
                self.d.pop(key, None)
                self.d[key] = (s, g)
        while len(self.d) > self.capacity:
            del self.d[next(iter(self.d))]

    def forget(self, keys) -> None:  # type: ignore[no-untyped-def]
        for key in keys:
            self.d.pop(key, None)

    def run(self, keys):  # type: ignore[no-untyped-def]
        out = []
        for key in keys:
            if key not in self.d:
                break
            out.append(self.d[key])
        return [s for s, _ in out], [g for _, g in out]


_op = st.one_of(
    st.tuples(st.just("learn"), st.lists(st.tuples(st.integers(0, 30), st.one_of(st.none(), st.integers(0, 9)),
                                                   st.integers(-3, 3)), max_size=12)),
    st.tuples(st.just("forget"), st.lists(st.integers(0, 30), max_size=6)),
    st.tuples(st.just("run"), st.lists(st.integers(0, 30), max_size=12)),
)


@settings(max_examples=examples(300), deadline=None)
@given(st.integers(1, 20), st.lists(_op, max_size=60), st.booleans())
def test_each_op_agrees_with_the_plain_dict_semantics(capacity: int, ops: list,  # type: ignore[type-arg]
                                                      crafted: bool) -> None:
    """Learns (re-learns, skipped pairs), forgets and runs in any order over a small key space, so that buckets collide,
    probes wrap, deletions shift entries back and the learn-order ring fills and compacts: the cache in use (compiled
    where built) and the plain model give the same runs and sizes after every op. `crafted`: keys that differ only in
    their last byte (most of the bits the bucket is taken from are equal)."""
    key = (lambda i: bytes(15) + bytes([i])) if crafted else (lambda i: i.to_bytes(8, "little") * 2)
    c, model = SlotCache(capacity), _DictModel(capacity)
    for kind, args in ops:
        if kind == "learn":
            keys, slots, gens = [key(i) for i, _, _ in args], [s for _, s, _ in args], [g for _, _, g in args]
            c.learn(keys, slots, gens)
            model.learn(keys, slots, gens)
        elif kind == "forget":
            c.forget([key(i) for i in args])
            model.forget([key(i) for i in args])
        else:
            assert c.run([key(i) for i in args]) == model.run([key(i) for i in args])
        assert len(c) == len(model.d) <= capacity
    assert all(c.run([k]) == ([s], [g]) for k, (s, g) in model.d.items())


@pytest.mark.parametrize("form", ["native", "dict"])
def test_bad_keys_and_negative_slots_are_refused_before_anything_changes(form: str) -> None:
    if form == "native" and NATIVE is None:
        pytest.skip("the compiled helpers are not built")
    c = SlotCache(10)
    if form == "dict":
        c._map = None
    c.learn([k(0)], [1], [1])
    with pytest.raises(ValueError, match="16 bytes"):
        c.learn([k(1), b"short"], [2, 3], [1, 1])
    with pytest.raises(TypeError, match="bytes"):
        c.learn([k(1), "not bytes"], [2, 3], [1, 1])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="negative"):
        c.learn([k(1), k(2)], [2, -1], [1, 1])
    with pytest.raises(ValueError, match="16 bytes"):
        c.forget([k(0), b"short"])
    assert len(c) == 1 and c.run([k(0), k(1)]) == ([1], [1])


@pytest.mark.skipif(NATIVE is None, reason="the compiled helpers are not built")
def test_a_full_cache_keeps_working_through_many_generations_of_learns() -> None:
    """Far more learns than capacity, with re-learns of the live keys in between (stale ring events): the ring compacts
    and the newest `capacity` keys stay findable."""
    c = SlotCache(100)
    for i in range(20_000):
        c.learn([k(i)], [i], [i])
        if i % 3 == 0 and i >= 50:
            c.learn([k(i - 50)], [i], [i])  # still live: moves to the newest
    assert len(c) == 100
    assert c.run([k(19_999), k(19_998)]) == ([19_999, 19_998], [19_999, 19_998])
    assert c.run([k(19_999 - 100)]) == ([], [])


@pytest.mark.skipif(NATIVE is None, reason="the compiled helpers are not built")
def test_the_compiled_map_refuses_use_before_its_table_exists() -> None:
    """`SlotMap.__new__` alone makes no table: every method raises instead of touching memory it does not have."""
    assert NATIVE is not None
    m = NATIVE.SlotMap.__new__(NATIVE.SlotMap)
    for call in (lambda: m.run([k(0)]), lambda: m.learn([k(0)], [1], [1]), lambda: m.forget([k(0)]),
                 lambda: m.run_verified([k(0)], np.zeros(4, np.int64), np.zeros(4, np.int64))):
        with pytest.raises(RuntimeError, match="not initialised"):
            call()
    with pytest.raises(ValueError):
        NATIVE.SlotMap(0)
