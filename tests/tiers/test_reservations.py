"""Abandoned reservations (issue 39, item 8; `kvproc/tiers/reservations.py`): a store that never got its save's ticket
aborts the save by the reservation id it sent. Against a real host-tier process over its socket: an abandon after the
reserve aborts the save it opened; one before it makes the tier refuse the reserve; a committed save is untouched.
The stall that makes this happen end to end is in `test_tier_replay.py`."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvproc.ipc import messages as m
from kvproc.ipc.client import RpcClient
from kvproc.runtime import Cluster, RoleConfig, launch
from kvproc.tiers.reservations import Reservations

_CONFIGURE = m.Configure("test-fingerprint", m.HostLayoutSpec([m.RegionSpec("kv", "kv", 0, 4096, 16)], 16, {}, 65536))


@pytest.fixture(scope="module")
def tier() -> Iterator[Cluster]:
    with launch([RoleConfig("host_tier", options={"host_bytes": 1 << 20})], cluster_name=f"resv{os.getpid()}") as c:
        c.client("host_tier").request(_CONFIGURE, timeout=10)
        yield c


def _reserve(client: RpcClient, req_id: str, reservation: int) -> m.TierSaveTicket | m.TierShed:
    return client.request(m.ReserveSave(req_id, [req_id.encode().ljust(16, b"k")], [], "cacheable", None,
                                        reservation), timeout=10)


def _stats(client: RpcClient) -> dict[str, int]:
    return dict(client.request(m.TierStats(), timeout=10).counters)


def test_an_abandon_after_the_reserve_aborts_the_save_it_opened(tier: Cluster) -> None:
    c = tier.client("host_tier")
    before = _stats(c)
    ticket = _reserve(c, "after", 1001)
    assert isinstance(ticket, m.TierSaveTicket) and _stats(c)["open_saves"] == before["open_saves"] + 1
    c.request(m.AbortSave(0, False, 1001), timeout=10)
    st = _stats(c)
    assert st["open_saves"] == before["open_saves"] and st["pending_pages"] == before["pending_pages"]
    assert st["saves_aborted_abandoned"] == before.get("saves_aborted_abandoned", 0) + 1
    with pytest.raises(Exception, match="save_reclaimed|given back"):  # its store can never commit it now
        c.request(m.CommitSave(ticket.save_id), timeout=10)


def test_an_abandon_before_the_reserve_makes_the_tier_refuse_it(tier: Cluster) -> None:
    c = tier.client("host_tier")
    before = _stats(c)
    c.request(m.AbortSave(0, False, 2002), timeout=10)  # the reserve is still on its way (a stalled tier's socket)
    shed = _reserve(c, "before", 2002)
    assert isinstance(shed, m.TierShed) and "abandoned" in shed.reason
    st = _stats(c)
    assert st["open_saves"] == before["open_saves"] and st["reserves_refused_abandoned"] == \
        before.get("reserves_refused_abandoned", 0) + 1
    assert st["abandoned_reservations_remembered"] >= 1
    assert isinstance(_reserve(c, "before", 2003), m.TierSaveTicket)  # another reservation id is served
    c.request(m.AbortSave(0, False, 2003), timeout=10)


def test_an_abandon_of_a_committed_save_changes_nothing(tier: Cluster) -> None:
    c = tier.client("host_tier")
    ticket = _reserve(c, "done", 3003)
    assert isinstance(ticket, m.TierSaveTicket)
    c.request(m.CommitSave(ticket.save_id), timeout=10)
    entries = _stats(c)["entries"]
    c.request(m.AbortSave(0, False, 3003), timeout=10)
    assert _stats(c)["entries"] == entries
    hit = c.request(m.Query("q", [b"done".ljust(16, b"k")]), timeout=10)
    assert isinstance(hit, m.TierHit) and hit.pages == 1
    c.request(m.ReleaseLease(hit.lease_id), timeout=10)


def test_remembered_abandons_expire_and_are_bounded() -> None:
    now = [0.0]
    r = Reservations(remember_s=10.0, clock=lambda: now[0], max_remembered=2)
    assert r.abandon(1) is None and r.abandon(2) is None and r.refuse(1) and r.refuse(2)
    assert r.abandon(3) is None and not r.refuse(1) and r.forgotten_full == 1  # the oldest went
    now[0] = 11.0
    r.expire()
    assert r.remembered == 0 and not r.refuse(3)
    r.opened(4, 40)
    r.settled(40)  # committed: its reservation is forgotten, a later abandon only remembers the id
    assert r.abandon(4) is None
    r.opened(5, 50)
    assert r.abandon(5) == 50 and r.abandon(5) is None  # found once; the repeat (a replay) is harmless


def _saved(c: RpcClient, key: bytes) -> None:
    ticket = c.request(m.ReserveSave("s", [key], [], "cacheable", None, 0), timeout=10)
    assert isinstance(ticket, m.TierSaveTicket)
    c.request(m.CommitSave(ticket.save_id), timeout=10)


def test_a_query_claim_abandoned_after_the_query_releases_its_lease(tier: Cluster) -> None:
    c = tier.client("host_tier")
    key = b"claimed".ljust(16, b"k")
    _saved(c, key)
    before = _stats(c)
    hit = c.request(m.Query("q", [key], None, 4004), timeout=10)
    assert isinstance(hit, m.TierHit) and _stats(c)["open_leases"] == before["open_leases"] + 1
    c.request(m.ReleaseLease(0, "", 4004), timeout=10)
    st = _stats(c)
    assert st["open_leases"] == before["open_leases"]
    assert st["leases_released_abandoned"] == before.get("leases_released_abandoned", 0) + 1
    c.request(m.ReleaseLease(0, "", 4004), timeout=10)  # a replay of the same release: nothing more
    assert _stats(c)["leases_released_abandoned"] == st["leases_released_abandoned"]


def test_a_query_claim_abandoned_before_the_query_makes_the_tier_answer_a_miss(tier: Cluster) -> None:
    c = tier.client("host_tier")
    key = b"early".ljust(16, b"k")
    _saved(c, key)
    before = _stats(c)
    c.request(m.ReleaseLease(0, "", 5005), timeout=10)  # the query is still on its way (a stalled tier's socket)
    assert isinstance(c.request(m.Query("q", [key], None, 5005), timeout=10), m.TierMiss)
    st = _stats(c)
    assert st["open_leases"] == before["open_leases"]
    assert st["queries_refused_abandoned"] == before.get("queries_refused_abandoned", 0) + 1
    hit = c.request(m.Query("q", [key], None, 5006), timeout=10)  # another claim is served
    assert isinstance(hit, m.TierHit)
    c.request(m.ReleaseLease(hit.lease_id), timeout=10)  # released by its id: its claim is settled
    c.request(m.ReleaseLease(0, "", 5006), timeout=10)
    assert _stats(c).get("leases_released_abandoned", 0) == before.get("leases_released_abandoned", 0)


def test_open_claims_whose_lease_ended_otherwise_are_pruned() -> None:
    r = Reservations(remember_s=10.0, clock=lambda: 0.0)
    r.opened(6, 60)
    r.opened(7, 70)
    r.prune(lambda lease_id: lease_id == 70)  # lease 60 was reclaimed by its TTL
    assert r.abandon(6) is None and r.abandon(7) == 70
