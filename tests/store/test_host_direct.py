"""`HostDirect`, the host tier for an engine that moves its own bytes (the vLLM connector's direct path): a save
written through the engine's own view of the tier's segment comes back through a lookup, bit for bit; a lease that has
lost its slots (the tier handed one to another save) or is too old is not trusted for a copy."""

from __future__ import annotations

import numpy as np

from kvproc.store.host_direct import HostDirect
from kvproc.store.tier_slots import LEASE_SAFE_S
from tests.conftest import cluster_store


def _keys(prefix: bytes, n: int) -> list[bytes]:
    return [prefix + i.to_bytes(4, "little") + bytes(12 - len(prefix)) for i in range(n)]


def test_a_direct_save_comes_back_through_a_lookup_bit_for_bit() -> None:
    with cluster_store() as (cs, store, model):
        hd = HostDirect(store, cs.host_segment)
        try:
            keys = _keys(b"a", 3)
            arena = next(iter(hd.views))
            rows = np.random.default_rng(0).integers(0, 256, (3, hd.views[arena].shape[1]), dtype=np.uint8)

            def write(ticket: object) -> None:
                for i, slot in enumerate(ticket.page_slots):  # type: ignore[attr-defined]
                    hd.views[arena][slot] = rows[i]

            assert hd.save("r1", keys, write)
            hit = hd.lookup("r2", keys).result(10)
            assert hit is not None and hit.pages == 3
            got = np.stack([hd.views[arena][s] for s in hit.page_slots])
            assert np.array_equal(got, rows)
            assert hd.intact(hit.page_slots, hit.page_gens, 0.0, 1.0)
            assert not hd.intact(hit.page_slots, hit.page_gens, 0.0, LEASE_SAFE_S + 1)  # too old: not trusted
            hd.release(hit.lease_id)
            assert store.outcomes.counts["save.ok"] == 1
        finally:
            hd.close()


def test_a_slot_handed_to_another_save_fails_the_lease_check() -> None:
    """The control of the check: the same leased slots and generations, once the tier has given one of the slots to
    another save (the lease released, the tier full of newer pages), no longer pass."""
    with cluster_store(host_bytes=256 << 10) as (cs, store, model):
        hd = HostDirect(store, cs.host_segment)
        try:
            first = _keys(b"f", 2)
            assert hd.save("r1", first, lambda t: None)
            hit = hd.lookup("r2", first).result(10)
            assert hit is not None and hd.intact(hit.page_slots, hit.page_gens, 0.0, 1.0)
            hd.release(hit.lease_id)
            slots = hd.layout.page_slots
            for i in range(2 * slots):  # newer pages: the tier evicts the old ones and hands their slots out again
                hd.save(f"w{i}", [b"w" * 12 + i.to_bytes(4, "little")], lambda t: None)
            assert not hd.intact(hit.page_slots, hit.page_gens, 0.0, 1.0)
        finally:
            hd.close()


def test_retain_hints_the_prefix_the_tier_holds_and_copies_nothing() -> None:
    """`HostDirect.retain` (the vLLM connector's retention hint): the tier holds pages 0-1 of a 4-page prompt; the
    hint reaches those two (re-ranked, `pages_retain_hinted`), the reservation that found pages 2-3 missing is given
    back (they are no prefix hit without their bytes: nothing may be committed for them), and no slot stays taken.
    Control: a prompt the tier holds whole is reached whole, in one reservation."""
    with cluster_store() as (cs, store, model):
        hd = HostDirect(store, cs.host_segment)
        try:
            keys = _keys(b"p", 4)
            assert hd.save("r1", keys[:2], lambda t: None)
            free = store.stats()["tier"]["free_page_slots"]
            assert store.submit(hd.retain("r2", keys, 600.0)).result(10) == 2
            st = store.stats()["tier"]
            assert st["pages_retain_hinted"] == 2 and st["saves_with_retain_hint"] == 2  # 4 pages, then the 2 held
            assert st["free_page_slots"] == free and st.get("open_saves", 0) == 0
            hit = hd.lookup("r3", keys).result(10)
            assert hit is not None and hit.pages == 2  # pages 2-3 were never committed
            hd.release(hit.lease_id)
            whole = _keys(b"w", 3)
            assert hd.save("r4", whole, lambda t: None)
            assert store.submit(hd.retain("r5", whole, 600.0)).result(10) == 3
            assert store.stats()["tier"]["saves_with_retain_hint"] == 3
        finally:
            hd.close()
