"""`kvproc console status` shows the store's counters and terminal outcomes (the launcher process embeds the store)."""

from __future__ import annotations

import json

from kvproc import RequestKv
from kvproc.runtime import console
from kvproc.store.cluster import ClusterStore
from kvproc.store.types import SealCursor
from tests.store.conftest import SharedMemoryModel


def test_console_status_shows_store_outcomes_and_pool_counters(capsys) -> None:  # type: ignore[no-untyped-def]
    with ClusterStore.start(1 << 20) as cs:
        model = SharedMemoryModel(cs.allocator)
        store = cs.attach_model(model, live_slots=2)
        kv = RequestKv(store.pools[0], "a", list(range(8)), 0)
        assert kv.try_admit()
        kv.schedule(8)
        kv.apply()
        store.execute_copies(0, kv.seal_by_copy())  # the bounded group's checkpoint at the 8-token boundary
        store.retire(0, kv, SealCursor.after_prefix(0))
        store.flush_saves(0)
        store.resolve_prefix_sync(0, "b", list(range(9))).hold.release()
        capsys.readouterr()
        assert console.main(["status", "--json", "--runtime-dir", cs.cluster.runtime_dir]) == 0
        out = json.loads(capsys.readouterr().out)
    text = json.dumps(out)
    for key in ("outcome.resolve.ok", "outcome.save.ok", "outcome.retire.ok", "rank0.indexed_pages"):
        assert key in text, key
