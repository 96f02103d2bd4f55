"""`HandoffPins` (which Mooncake keys a producer's hand-off created, until revoked or lapsed): pure book-keeping."""

from __future__ import annotations

from collections import Counter

from kvproc.tiers.mooncake_pins import HandoffPins


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_revoke_returns_the_keys_its_write_created_once() -> None:
    c: Counter[str] = Counter()
    pins = HandoffPins(10.0, c, clock=Clock())
    assert pins.record("p", ["k1", "k2"]) == [] and pins.record("p", ["k3"]) == []  # two saves of one hand-off
    assert pins.revoke("p") == ["k1", "k2", "k3"] and pins.revoke("p") == []
    assert c["handoff_keys_pinned"] == 3 and pins.producers == 0


def test_a_write_that_ends_after_its_revoke_is_removed_at_once() -> None:
    c: Counter[str] = Counter()
    pins = HandoffPins(10.0, c, clock=Clock())
    assert pins.revoke("p") == []
    assert pins.record("p", ["k1"]) == ["k1"] and pins.producers == 0
    assert c["handoff_revoked_before_written"] == 1


def test_pins_lapse_at_the_ttl_and_are_bounded() -> None:
    c: Counter[str] = Counter()
    clock = Clock()
    pins = HandoffPins(10.0, c, clock=clock, max_producers=2)
    pins.record("a", ["ka"])
    clock.now = 5.0
    pins.record("b", ["kb"])
    clock.now = 10.0
    pins.expire()
    assert pins.producers == 1 and c["handoff_pins_lapsed"] == 1  # consumed elsewhere: Mooncake's pin lapses too
    assert pins.revoke("a") == []  # lapsed: nothing left to remove
    pins.record("c", ["kc"])
    pins.record("d", ["kd"])
    assert pins.producers == 2 and c["handoff_pins_forgotten_full"] == 1 and pins.revoke("b") == []
