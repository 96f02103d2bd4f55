"""The prefix index reports every change of its key set (KV events' source, `PagedBlocks.listener`): replaying the
reports rebuilds the index's keys exactly, through evictions, a re-registered page, a displaced duplicate and
`evict_all`, in the compiled helpers and in the pure-Python forms alike (they report the same sequence)."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from kvproc import native
from kvproc.core import paged
from kvproc.core.paged import PagedBlocks

FORMS = ["python"] + (["native"] if native.NATIVE is not None else [])


class Recorder:
    """An `IndexListener` that keeps the reports: ("stored", [(hashes of a run)...]) / ("removed", hashes)."""

    def __init__(self) -> None:
        self.log: list[tuple[str, list[bytes]]] = []

    def stored(self, hashes: Sequence[bytes], positions: list[int], tokens: object = None, first_page: int = 0,
               parent: bytes | None = None) -> None:
        assert positions == sorted(set(positions))
        self.log.append(("stored", [hashes[p] for p in positions]))

    def removed(self, hashes: list[bytes]) -> None:
        self.log.append(("removed", list(hashes)))


def rebuild(log: list[tuple[str, list[bytes]]], drop: str = "") -> set[bytes]:
    keys: set[bytes] = set()
    for kind, hashes in log:
        if kind == drop:
            continue
        if kind == "stored":
            assert drop or not keys & set(hashes), "a key stored twice without a removal between"
            keys.update(hashes)
        else:
            assert drop or set(hashes) <= keys, "a key removed that was never stored"
            keys.difference_update(hashes)
    return keys


def _h(i: int) -> bytes:
    return i.to_bytes(16, "big")


def churn(pb: PagedBlocks, seed: int) -> list[str]:
    """Random allocations (which evict), registrations (fresh keys, keys already indexed by another block: a
    duplicate that displaces it, and the same blocks again: a re-registration), releases and evict_all. Returns the
    kinds of step it took (the test checks each happened)."""
    rng = random.Random(seed)
    held: list[list[int]] = []
    did: list[str] = []
    for _ in range(400):
        r = rng.random()
        if r < 0.45 and pb.available >= 4:
            n = rng.randint(1, 4)
            before = pb.evictions
            ids = pb.allocate(n)
            if pb.evictions > before:
                did.append("evicted")
            base = rng.randint(0, 40)  # a small key space: duplicates of indexed keys are common
            hashes = [_h(base + k) for k in range(n)]
            dup = any(h in pb.index for h in hashes)
            pb.register(ids, hashes)
            did.append("duplicate" if dup else "fresh")
            if rng.random() < 0.3:
                pb.register(ids, hashes)  # the same blocks again: no change
                did.append("reregistered")
            held.append(ids)
        elif r < 0.9 and held:
            pb.release(held.pop(rng.randrange(len(held))))
        elif r < 0.93 and pb.evict_all():
            did.append("evict_all")
    return did


@pytest.mark.parametrize("form", FORMS)
def test_the_reports_rebuild_the_index_through_churn(form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if form == "python":
        monkeypatch.setattr(paged, "NATIVE", None)
    pb = PagedBlocks(24)
    rec = Recorder()
    pb.listener = rec
    did = churn(pb, seed=7)
    assert {"evicted", "duplicate", "reregistered", "evict_all", "fresh"} <= set(did)
    assert rebuild(rec.log) == set(pb.index)
    # controls: a subscriber that misses either kind of report ends with a different set
    assert rebuild(rec.log, drop="removed") != set(pb.index)
    assert rebuild(rec.log, drop="stored") != set(pb.index)


def test_a_displaced_duplicate_is_no_removal() -> None:
    """Two blocks registered under one key: the newer owns the entry; evicting the older removes nothing (a
    subscriber that took every evicted block's key for a removal would lose a key the index still holds)."""
    pb = PagedBlocks(4)
    rec = Recorder()
    pb.listener = rec
    a, b = pb.allocate(1), pb.allocate(1)
    pb.register(a, [_h(1)])
    pb.register(b, [_h(1)])  # displaces a
    pb.release(a)
    pb.release(b)
    pb.allocate(3)  # 2 free + evicts a (the LRU's oldest), not b
    assert set(pb.index) == {_h(1)}
    assert rec.log == [("stored", [_h(1)])]
    pb.evict_all()
    assert rec.log[-1] == ("removed", [_h(1)]) and not pb.index


def test_both_forms_report_the_same_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    if native.NATIVE is None:
        pytest.skip("kvproc.native._native not built")
    logs = []
    for form in ("native", "python"):
        if form == "python":
            monkeypatch.setattr(paged, "NATIVE", None)
        pb = PagedBlocks(24)
        rec = Recorder()
        pb.listener = rec
        churn(pb, seed=11)
        logs.append(rec.log)
    assert logs[0] == logs[1]


def test_without_a_listener_nothing_is_reported_and_the_index_is_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    with_l, without = PagedBlocks(24), PagedBlocks(24)
    with_l.listener = Recorder()
    churn(with_l, seed=3)
    churn(without, seed=3)
    assert with_l.index == without.index and with_l.block_hash == without.block_hash
