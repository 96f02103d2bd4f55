"""The engine's step fence through the store and a real copy worker (issue 19, "ordering with the engine"): the
store reads `step_fence(rank)` when it issues a save (at `seal`, on the engine's thread) and a device copy, and puts
the handle into the order; a copy worker attached to host memory (every worker here: no CUDA) refuses such an order
with `event_unsupported`, a terminal outcome with the request id, nothing half-applied; without a fence the orders
carry None and everything works as before. The engine side is `_EngineFenceStub` (it hands out made-up 64-byte
handles: no CUDA event exists here); `_RecordingCopierSpy` forwards every order to the real copier and keeps it.
The GPU test (a save that really waits on an engine's event) is skipped without CUDA."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from kvproc.ipc import messages as m
from kvproc.ipc.orders import SaveOrder, SlotCopy
from kvproc.store.kv_store import KvStore
from kvproc.store.types import SealCursor
from tests.conftest import check_bytes, churn, cluster_store, compute, wait_for

pytestmark = pytest.mark.timeout(90)
CUDA = torch.cuda.is_available()


class _EngineFenceStub:
    """The engine side of `step_fence` (test only): while `on`, each call returns a new 64-byte handle (so which call
    an order's handle came from is visible); else None. Remembers the ranks it was asked for."""

    def __init__(self, on: bool = True) -> None:
        self.on = on
        self.calls: list[int] = []
        self.given: list[bytes | None] = []
        self.threads: set[str] = set()  # who called: the engine's thread (the test's), never the store's loop

    def __call__(self, rank: int) -> bytes | None:
        self.calls.append(rank)
        self.threads.add(threading.current_thread().name)
        handle = bytes([len(self.calls)]) * 64 if self.on else None
        self.given.append(handle)
        return handle


class _RecordingCopierSpy:
    """The real copier, keeping every save order and device copy's event (test only)."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.saves: list[SaveOrder] = []
        self.device_events: list[bytes | None] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def save(self, order: SaveOrder) -> int:
        self.saves.append(order)
        return int(await self.inner.save(order))

    async def device_copy(self, copies: list[SlotCopy], after_event: bytes | None = None) -> int:
        self.device_events.append(after_event)
        return int(await self.inner.device_copy(copies, after_event))


def _spy(store: KvStore) -> _RecordingCopierSpy:
    spy = _RecordingCopierSpy(store.copiers[0])
    store.copiers = (spy,)
    return spy


def _worker(cs: Any) -> dict[str, int]:
    return dict(cs.cluster.client("copy_worker").request(m.Stats(), timeout=5).counters)


def test_a_fenced_save_is_refused_on_a_cpu_attach_with_its_reason_and_a_later_unfenced_save_works() -> None:
    fence = _EngineFenceStub()
    with cluster_store(step_fence=fence) as (cs, store, model):
        spy = _spy(store)
        toks = list(range(1, 10))  # two full pages
        kv, cur, _, _ = compute(store, model, "a", toks)
        store.retire(0, kv, cur)
        store.flush_saves(0, 10)
        # the order carried the handle the fence gave at the seal, read once, on the engine's thread
        assert fence.calls == [0] and [o.after_event for o in spy.saves] == fence.given
        assert fence.threads == {threading.current_thread().name}
        # a terminal state with the request id and the worker's reason; counted; loud
        (out,) = store.outcomes.for_request("a", "save")
        assert (out.state, out.reason) == ("failed", "event_unsupported")
        assert store.counters["save_failed"] == 1 and "save_ok" not in store.counters
        worker = _worker(cs)
        assert worker["saves_event_unsupported"] == 1 and worker["copy_errors"] == 1
        assert "orders_save" not in worker and "bytes_save" not in worker  # no byte moved
        # nothing half-applied: the tier's reservation aborted, nothing committed, nothing left pinned
        wait_for(lambda: store.stats()["tier"]["open_saves"] == 0, what="the save aborted")
        assert store.pinned_blocks(0) == 0 and cur.pending == 0
        churn(store)
        pre = store.resolve_prefix_sync(0, "a2", toks)
        assert pre.host_tokens == 0
        pre.hold.release()
        # the engine stops giving a fence (a step with nothing to wait for): the next save goes through
        fence.on = False
        other = list(range(50, 59))
        kv, cur, _, written = compute(store, model, "b", other)
        store.retire(0, kv, cur)
        store.flush_saves(0, 10)
        assert spy.saves[-1].after_event is None
        assert [(o.state, o.reason) for o in store.outcomes.for_request("b", "save")] == [("ok", "")]
        wait_for(lambda: store.stats()["tier"]["open_saves"] == 0, what="the save committed")
        churn(store)
        model.zero()
        pre = store.resolve_prefix_sync(0, "b2", other)
        assert pre.host_tokens == 8
        check_bytes(model, pre, written)
        pre.hold.release()
        assert _worker(cs)["orders_save"] == 1


def test_a_fence_that_is_not_bytes_is_refused_at_the_seal_before_anything_is_pinned() -> None:
    with cluster_store(step_fence=lambda rank: "not a handle") as (_, store, model):  # type: ignore[arg-type,return-value]
        kv, cur, _, _ = compute(store, model, "a", list(range(1, 10)))
        with pytest.raises(TypeError, match=r"step_fence\(0\) returned a str"):
            store.seal(0, kv, cur)
        assert (cur.pages, cur.pending) == (0, 0) and store.pinned_blocks(0) == 0
        assert store.outcomes.for_request("a", "save") == []
        kv.release()


def test_device_copies_carry_the_fence_and_a_cpu_attach_refuses_them_without_writing() -> None:
    fence = _EngineFenceStub()
    with cluster_store(bounded=True, step_fence=fence) as (cs, store, model):
        spy = _spy(store)
        toks = list(range(1, 17))
        kv, cur, _, _ = compute(store, model, "a", toks)
        staging_before = [model.slot(a, s).clone() for a in range(2) for s in range(6)]
        assert store.execute_copies(0, kv.seal_by_copy()) is False  # refused: the orders are fenced as failed
        assert spy.device_events == fence.given[:1] and fence.given[0] is not None
        assert not kv.checkpoint_sealed()
        assert all(torch.equal(model.slot(a, s), staging_before[a * 6 + s]) for a in range(2) for s in range(6))
        assert _worker(cs)["devices_event_unsupported"] == 1
        fence.on = False  # the engine retries the checkpoint with no fence to give
        assert store.execute_copies(0, kv.seal_by_copy()) is True and kv.checkpoint_sealed()
        assert spy.device_events[-1] is None
        store.retire(0, kv, cur)
        store.flush_saves(0, 10)
        assert [(o.state, o.reason) for o in store.outcomes.for_request("a", "save")] == [("ok", "")]
        assert fence.calls == [0, 0, 0]  # each device copy, then the seal of the retire
        assert fence.threads == {threading.current_thread().name}


def test_without_a_step_fence_every_order_carries_none_and_nothing_is_called() -> None:
    with cluster_store(bounded=True) as (cs, store, model):
        assert store.step_fence is None
        spy = _spy(store)
        kv, cur, _, _ = compute(store, model, "a", list(range(1, 17)))
        assert store.execute_copies(0, kv.seal_by_copy()) is True
        store.retire(0, kv, cur)
        store.flush_saves(0, 10)
        assert spy.device_events == [None] and [o.after_event for o in spy.saves] == [None]
        assert [(o.state, o.reason) for o in store.outcomes.for_request("a", "save")] == [("ok", "")]
        worker = _worker(cs)
        assert worker["orders_save"] == 1 and worker["orders_device"] == 1 and "copy_errors" not in worker


@pytest.mark.skipif(not CUDA, reason="no CUDA device (torch.cuda.is_available() is False): a save waiting on the "
                                     "engine's step event on the GPU has never run")
def test_on_a_gpu_a_save_issued_right_after_an_unfinished_step_copies_what_the_step_wrote() -> None:
    """NEVER RUN. The 'engine' writes the pages on its stream behind a long kernel and records its step event; the
    store seals at once (no synchronisation): the worker's save stream waits on that event, so the saved bytes are
    the step's, not the zeros before it."""
    from kvproc.engine.step_events import StepEvents

    def gpu(name: str, n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.uint8, device="cuda:0")

    events = StepEvents(torch.device("cuda", 0))
    with cluster_store(allocator=gpu, step_fence=lambda rank: events.latest) as (_, store, model):
        toks = list(range(1, 9))
        from tests.conftest import admit

        kv, _ = admit(store, "a", toks)
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # the step's long kernel, on the engine's (current) stream
        for b in kv.block_ids[:2]:
            for a in range(2):
                model.block(a, b).fill_(0xA5)  # queued behind it
        events.record()
        kv.apply()
        cur = SealCursor.after_prefix(0)
        store.retire(0, kv, cur)  # at once: the step has not finished
        store.flush_saves(0, 30)
        assert [(o.state, o.reason) for o in store.outcomes.for_request("a", "save")] == [("ok", "")]
        torch.cuda.synchronize()
        churn(store)
        model.zero()
        pre = store.resolve_prefix_sync(0, "b", toks)
        assert pre.host_tokens == 8
        for b in pre.hold.block_ids:
            assert bool((model.block(0, b) == 0xA5).all()) and bool((model.block(1, b) == 0xA5).all())
        pre.hold.release()
