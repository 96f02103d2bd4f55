"""`store.drop_device_cache(rank)` / `pool.evict_cached()`: the device cache goes cold on purpose (issue 18), so a
model author's "restore from host" test needs no trick; what someone still holds stays."""

from __future__ import annotations

import torch

from tests.store.conftest import compute, make_store


def test_after_dropping_the_device_cache_the_prefix_comes_back_from_the_host_bit_for_bit() -> None:
    store, model, _, _ = make_store(bounded=True)
    with store:
        toks = list(range(1, 17))
        kv, cur, _, written = compute(store, model, "a", toks)
        store.execute_copies(0, kv.seal_by_copy())  # the bounded checkpoint at the 16-token boundary
        store.retire(0, kv, cur)
        store.flush_saves(0)
        toks = toks + [1]  # a hit leaves at least one prompt token to compute
        warm = store.resolve_prefix_sync(0, "b", toks)
        assert warm.device_tokens == 16 and warm.host_tokens == 0  # the control: without the drop, a device hit
        warm.hold.release()
        freed = store.drop_device_cache(0)
        assert freed >= 4 + 1  # four pages and the checkpoint's staging slot
        assert store.pools[0].stats()["evicted_on_purpose"] == freed
        cold = store.resolve_prefix_sync(0, "c", toks)
        assert cold.device_tokens == 0 and cold.host_tokens == 16
        for i, b in enumerate(cold.hold.block_ids):
            h = cold.hold.hashes[i]
            assert torch.equal(model.block(0, b), written[h][0]) and torch.equal(model.block(1, b), written[h][1])
        cold.hold.release()


def test_blocks_someone_holds_are_not_evicted() -> None:
    store, model, _, _ = make_store()
    with store:
        toks = list(range(1, 10))
        kv, cur, _, _ = compute(store, model, "a", toks)
        held = store.pools[0].probe(kv.page_hashes, len(toks))
        assert held.num_blocks == 2
        kv.release()
        store.drop_device_cache(0)
        store.pools[0].check_hold(held)  # still valid: its blocks were referenced
        again = store.pools[0].probe(kv.page_hashes, len(toks))
        assert again.num_blocks == 2  # and still indexed
        again.release()
        held.release()
        store.drop_device_cache(0)
        gone = store.pools[0].probe(kv.page_hashes, len(toks))
        assert gone.num_blocks == 0
        gone.release()
