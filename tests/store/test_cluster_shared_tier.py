"""Two engines' stores share one standalone host tier (`kvproc up`): a P/D hand-off crosses it bit for bit, the
producer's Handoff lease is consumed by the decode side's load, and nothing outlives `kvproc down`."""

from __future__ import annotations

import os

import torch

from kvproc import RequestKv
from kvproc.store.cluster import ClusterStore
from kvproc.store.handoff import handoff_resolve_policy, padded_chain
from kvproc.store.types import SaveClass, SealCursor
from tests.conftest import kvproc_up
from tests.store.conftest import SharedMemoryModel


def test_handoff_between_two_engines_through_a_shared_kvproc_up_tier():
    with kvproc_up("sharedt") as (rd, _):
        with ClusterStore.start(1 << 20, tier_runtime_dir=rd) as P, ClusterStore.start(1 << 20, tier_runtime_dir=rd) as D:
            mp, md = SharedMemoryModel(P.allocator), SharedMemoryModel(D.allocator)
            sp, sd = P.attach_model(mp, live_slots=2), D.attach_model(md, live_slots=2)
            toks = list(range(1, 11))
            kv = RequestKv(sp.pools[0], "prod", toks, 4)
            assert kv.try_admit()
            kv.schedule(10)
            want = {}
            for b in kv.block_ids:
                mp.block(0, b)[:] = torch.randint(0, 256, (256,), dtype=torch.uint8)
            kv.apply()
            kv.pad_to_boundary()
            sp.execute_copies(0, kv.seal_by_copy())
            for h, b in zip(kv.page_hashes, kv.block_ids):
                want[h] = mp.block(0, b).clone()
            sp.retire(0, kv, SealCursor.after_prefix(0), SaveClass.HANDOFF)
            pre = sd.resolve_prefix_sync(0, "dec", padded_chain(toks, 10, 4), policy=handoff_resolve_policy("prod", 5))
            assert pre.host_tokens == 12 and pre.device_tokens == 0
            for h, b in zip(pre.hold.hashes, pre.hold.block_ids):
                assert torch.equal(md.block(0, b), want[h])
            pre.hold.release()
            tier = sd.stats()["tier"]
            assert tier["handoffs_consumed"] == 1 and tier["open_handoffs"] == 0


def test_an_engine_reattaches_to_a_shared_tier_that_stalled_and_answers_again():
    """SIGSTOP a `kvproc up` tier past the heartbeat liveness: the engine's client to it is declared dead (the store
    serves device-only meanwhile). Before, that was final for the engine; now it reconnects to the same tier process
    once it answers, and saves and restores go through it again."""
    import signal
    import time


    with kvproc_up("stallt") as (rd, tier_pid):
        with ClusterStore.start(1 << 20, tier_runtime_dir=rd) as cs:
            model = SharedMemoryModel(cs.allocator)
            store = cs.attach_model(model, live_slots=2)
            os.kill(tier_pid, signal.SIGSTOP)
            try:
                deadline = time.monotonic() + 20
                while store.tier is not None and store.tier.available:
                    assert time.monotonic() < deadline, "the stalled tier was never declared dead"
                    time.sleep(0.1)
            finally:
                os.kill(tier_pid, signal.SIGCONT)
            deadline = time.monotonic() + 20
            while not (store.tier is not None and store.tier.available):
                assert time.monotonic() < deadline, "never reconnected to the tier"
                time.sleep(0.1)
            assert cs.tier_reconnects == 1
            toks = list(range(1, 13))  # 3 full pages: a checkpoint at the last one (the model has a bounded group)
            kv = RequestKv(store.pools[0], "a", toks, 4)
            assert kv.try_admit()
            kv.schedule(12)
            kv.apply()
            store.execute_copies(0, kv.seal_by_copy())
            store.retire(0, kv, SealCursor.after_prefix(0))
            store.flush_saves(0, 10)
            assert store.outcomes.for_request("a", "save")[-1].state == "ok"
            assert store.stats()["tier"]["saves_committed"] >= 1
