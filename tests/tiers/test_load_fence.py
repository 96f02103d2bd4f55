"""A load order a stalled copy worker runs after its store gave up on it must not write blocks the store handed to
another request (found by `kvproc bench chaos`: a worker SIGSTOPped past its 3 s heartbeat liveness is declared dead,
the store frees the load's destination blocks, a new request computes its pages into them, and on SIGCONT the worker
runs the queued Load over them: device-pool pages then held another prompt's bytes while every outcome said ok).

The load fence (`kvproc/tiers/load_fence.py`) makes a given-up load unwritable before its blocks are freed."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from kvproc.store.types import StoreConfig
from tests.conftest import PAGE, churn, cluster_store, compute, wait_for

pytestmark = pytest.mark.timeout(90)


def test_a_load_run_by_a_worker_after_its_stall_never_overwrites_blocks_given_to_another_request() -> None:
    config = StoreConfig(resolve_deadline_s=30.0)
    with cluster_store(num_blocks=16, config=config) as (cs, store, model):
        toks = list(range(1, 18))  # 4 full pages, saved to the tier
        kv, cur, _, _ = compute(store, model, "a", toks)
        store.retire(0, kv, cur)
        store.flush_saves(0, 10)
        wait_for(lambda: store.stats()["tier"]["open_saves"] == 0, what="the save committed")
        churn(store)
        worker = cs.cluster.pid("copy_worker")
        client = cs.cluster.client("copy_worker")
        os.kill(worker, signal.SIGSTOP)
        try:
            pre = store.submit_resolve(0, "b", toks).result(20)  # ends once the stalled worker is declared dead
            assert pre.host_tokens == 0, "the worker was stopped: nothing can have been restored"
            assert not client.alive
            # every free block (the failed load's destinations among them) goes to a new request, which writes them
            other = [1000 + i for i in range(15 * PAGE)]
            kv2, cur2, pre2, written = compute(store, model, "c", other, max_out=PAGE)
            pre.hold.release()
        finally:
            os.kill(worker, signal.SIGCONT)
        cs.cluster.wait_available("copy_worker", timeout=20)  # reconnected: it is answering, so it ran its queue
        time.sleep(0.5)
        for page, b in enumerate(kv2.block_ids[: len(other) // PAGE]):
            h = kv2.page_hashes[page]
            assert torch.equal(model.block(0, b), written[h][0]) and torch.equal(model.block(1, b), written[h][1]), (
                f"block {b} (page {page} of request c) was overwritten by the stale load")
        kv2.release()
        assert store.stats()["rank0"]["active_blocks"] == 0


def test_a_device_copy_run_by_a_worker_after_its_stall_never_writes_its_destination_slot() -> None:
    """The same for a bounded slot copy (`execute_copies`: seal-by-copy / restore): once the store gave up on it (and
    fenced its slots as failed, free for others), the stalled worker's late run of it writes nothing."""
    from kvproc.ipc.orders import SlotCopy

    with cluster_store(bounded=True, config=StoreConfig(resolve_deadline_s=5.0)) as (cs, store, model):
        model.slot(0, 0)[:] = 7
        # one copy first: it works, and the loop's socket to the worker is connected (a first call on a new socket
        # to a stopped worker never gets past the handshake, so it could not show the bug)
        assert store._loop.submit(store.copiers[0].device_copy([SlotCopy("state", 0, 1)])).result(10) > 0
        assert bool((model.slot(0, 1) == 7).all())
        model.slot(0, 1)[:] = 0
        worker = cs.cluster.pid("copy_worker")
        os.kill(worker, signal.SIGSTOP)
        try:
            fut = store._loop.submit(store.copiers[0].device_copy([SlotCopy("state", 0, 1)]))
            with pytest.raises(Exception):  # PeerDead once the stalled worker is declared dead
                fut.result(20)
            model.slot(0, 1)[:] = 42  # the slot is someone else's now, and they write it
        finally:
            os.kill(worker, signal.SIGCONT)
        cs.cluster.wait_available("copy_worker", timeout=20)
        time.sleep(0.5)
        assert bool((model.slot(0, 1) == 42).all()), "the stale device copy overwrote the slot"
