"""A copy worker killed in the middle of a save's write left its claim on the save's fence, and the tier kept the
save's slots quarantined for good (found by `kvproc bench chaos`: one quarantined save per few SIGKILLs, never freed:
capacity lost for the tier's life). The store, which launched that worker, proves it dead and says so in its
`AbortSave(writer_dead=True)`; the tier then takes the claim back and frees the slots. A worker that is only stalled is
alive: its claim is a write in progress, and the slots stay quarantined until it ends (tests/test_save_fence.py)."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from kvproc.ipc.segment import Segment
from kvproc.store.types import SaveClass, StoreConfig
from kvproc.tiers import save_fence
from kvproc.tiers.host_index import HostIndex, SaveTicket
from kvproc.tiers.load_fence import process_gone
from kvproc.tiers.slot_table import FENCE
from kvproc.workers.copy_exec import fence_row
from tests.conftest import cluster_store, compute, wait_for
from tests.tiers.conftest import K

pytestmark = pytest.mark.timeout(60)


def test_an_abort_that_names_a_dead_writer_frees_a_claimed_saves_slots_and_a_plain_one_quarantines_them() -> None:
    for writer_dead in (False, True):
        idx = HostIndex(2, {})
        a = idx.reserve_save("a", K[:2])
        assert isinstance(a, SaveTicket)
        row = idx.slot_table[FENCE]
        save_fence.claim(row, a.fence, a.fence_token)  # the worker is writing when it dies (or stalls)
        assert idx.abort_save(a.save_id, writer_dead=writer_dead)
        st = idx.stats()
        if writer_dead:
            assert st["quarantined_saves"] == 0 and sorted(idx.free_pages) == [0, 1]
            assert st["fences_taken_from_dead_writers"] == 1
            with pytest.raises(save_fence.FenceRevoked):  # the word is revoked: nothing can claim it again
                save_fence.claim(row, a.fence, a.fence_token)
        else:
            assert st["quarantined_saves"] == 1 and not idx.free_pages


def test_a_worker_killed_mid_save_write_leaves_no_quarantined_slots_in_the_tier() -> None:
    config = StoreConfig(resolve_deadline_s=5.0)
    with cluster_store(config=config) as (cs, store, model):
        worker = cs.cluster.pid("copy_worker")
        client = cs.cluster.client("copy_worker")
        kv, cur, _, _ = compute(store, model, "a", list(range(1, 18)))
        os.kill(worker, signal.SIGSTOP)
        try:
            store.retire(0, kv, cur, SaveClass.CACHEABLE)
            wait_for(lambda: client.pending_count > 0, what="the save order in flight")
            # The worker "has started writing": claim the save's fence word on its behalf, as its copy does (in the
            # tier's segment, mapped here as a copy worker maps it).
            seg = Segment.attach(cs.host_segment)
            try:
                row = fence_row(seg.numpy(np.uint8), cs.host_layout)
                assert row is not None
                (index,) = np.flatnonzero(row)
                save_fence.claim(row, int(index), int(row[index]))
                del row
            finally:
                seg.close()
            os.kill(worker, signal.SIGKILL)
        finally:
            os.kill(worker, signal.SIGCONT)
        store.flush_saves(0, 10)
        assert process_gone(worker)
        assert store.outcomes.for_request("a", "save")[-1].state == "failed"
        wait_for(lambda: store.stats()["tier"]["open_saves"] == 0, what="the save aborted in the tier")
        tier = store.stats()["tier"]
        assert tier["quarantined_saves"] == 0, "the dead worker's claim kept the save's slots out of use"
        assert tier["fences_taken_from_dead_writers"] == 1
        cs.cluster.wait_available("copy_worker", timeout=15)


def test_a_writer_whose_pid_now_names_another_process_is_dead_and_its_load_fence_is_settled() -> None:
    """Issue 35's residual: the settle wait of a load fence a killed worker left claimed ended only when its pid was
    gone; a pid the kernel gave to another process read as the worker alive, and the wait never ended. The worker is
    now known by pid and start time. Simulated without waiting for the kernel to reuse a pid: a live process (this
    one) under another start time is exactly what a reused pid looks like.
    Control: the same live pid without its start time (today's bare pid) reads as alive, and the fence stays busy."""
    import numpy as np

    from kvproc.tiers.load_fence import LoadFences, ProcessId
    from kvproc.tiers.save_fence import claim

    me = ProcessId.of(os.getpid())
    assert me.start > 0 and not process_gone(me)
    reused = ProcessId(me.pid, me.start - 1)  # the worker started earlier, died; its pid went to this process
    assert process_gone(reused)
    assert not process_gone(me.pid)  # the control: a bare pid cannot tell

    fences = LoadFences(np.zeros(4, dtype=np.int64))
    word = fences.issue()
    assert word is not None
    claim(fences._table.row, *word)  # the worker claimed the word, then was killed mid-write
    assert not fences.try_settle(*word, me.pid)  # control: busy for good under a bare pid that lives on
    assert fences.try_settle(*word, reused) and fences.forced == 1
