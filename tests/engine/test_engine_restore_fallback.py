"""Issue 15 item 7: a failed bounded restore must not crash the reference engine. A copy worker that fails every
RESTORE copy (a fault-injecting fake around the real copier) makes `execute_copies` fence the request's orders as
failed; the engine gives the request's KV back and recomputes it from scratch, counted, so every request still
completes with the tokens (and logits) of an uncached run, and nothing is left in the pool."""

from __future__ import annotations

from typing import Any, Sequence

import pytest
import torch

from kvproc.engine.engine import Engine
from kvproc.engine.request import Request
from kvproc.engine.topology import PoolSizes, Topology, make_store
from kvproc.engine.workload import TurnRecord, WorkloadSpec, drive
from kvproc.ipc.orders import SlotCopy
from kvproc.store.kv_store import KvStore
from kvproc.tiers.api import Copier

RTOL = ATOL = 1e-4  # chunked vs one-shot prefill differ by ~1e-5 in float32
SPEC = WorkloadSpec(conversations=4, turns=3, first_input=64, new_per_turn=32, output_per_turn=8, concurrency=2,
                    seed=5)


class FailingRestoreCopier:
    """Fault-injecting fake (tests only): the real copier, except that a device copy batch holding a RESTORE copy
    (staging slot -> live slot of a bounded group) raises, as when the copy worker crashes during a restore. SEAL
    copies (live -> staging), saves and loads go through."""

    def __init__(self, inner: Copier, live_slots: dict[str, int]) -> None:
        self.inner = inner
        self.live_slots = live_slots  # bounded group -> its live slot count (slots below it are live)
        self.failed_restores = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    async def device_copy(self, copies: Sequence[SlotCopy], after_event: bytes | None = None) -> int:
        if any(c.group in self.live_slots and c.dst_slot < self.live_slots[c.group] for c in copies):
            self.failed_restores += 1
            raise RuntimeError("injected fault: the copy worker died during a restore")
        return await self.inner.device_copy(copies, after_event)


def _inject(store: KvStore) -> FailingRestoreCopier:
    pool = store.pools[0]
    fake = FailingRestoreCopier(store.copiers[0], {g: s.live_slots for g, s in pool.slabs.items()})
    store.copiers = (fake,)
    return fake


def _topo(mode: str, model: str, blocks: int) -> Topology:
    return make_store(mode, model, PoolSizes(device_blocks=blocks, live_slots=2, staging_slots=12,
                                             host_bytes=32 << 20), seed=3)


def _run(mode: str, model: str, blocks: int, *, fail_restores: bool
         ) -> tuple[list[TurnRecord], dict[str, int], dict[str, int], int]:
    with _topo(mode, model, blocks) as t:
        fake = _inject(t.store) if fail_restores else None
        eng = Engine(t.model, t.store, max_batch=2, chunk_tokens=48, checkpoint_every_pages=2,
                     prefix_cache=t.prefix_cache)
        recs = drive(eng, SPEC, t.model.vocab_size, keep_logits=True)
        t.store.flush_saves(0, 10)
        t.store.flush_loads(0, 10)
        return recs, eng.stats(), t.store.pools[0].stats(), fake.failed_restores if fake else 0


@pytest.mark.parametrize("mode", ["device_only", "kvproc"])
@pytest.mark.parametrize("model", ["hybrid", "swa"])
def test_every_request_completes_with_the_uncached_tokens_when_every_restore_fails(model: str, mode: str) -> None:
    ref, _, _, _ = _run("no_cache", model, 128, fail_restores=False)
    # 20 blocks: the later turns' prefixes come back from the device pool or (kvproc) after eviction from the host
    # tier; every one of those restores fails.
    got, eng, pool, failed = _run(mode, model, 20, fail_restores=True)
    assert failed > 0 and eng["restore_failed_recomputed"] == failed, (failed, eng)
    assert all(r.failed is None for r in got), [r.failed for r in got]
    by_key = {(r.conversation, r.turn): r for r in ref}
    assert len(got) == len(ref) == SPEC.conversations * SPEC.turns
    for r in got:
        x = by_key[(r.conversation, r.turn)]
        assert r.output == x.output, (r.conversation, r.turn)
        torch.testing.assert_close(torch.stack(r.logits), torch.stack(x.logits), rtol=RTOL, atol=ATOL)
        assert r.device_hit_tokens == r.host_hit_tokens == 0  # recomputed: nothing of its prefix was used
    # Nothing stranded: no request admitted, no block in use or entitled, no order open, every live slot back.
    assert eng["running"] == eng["inbox"] == eng["resolving"] == 0
    assert pool["admitted_requests"] == 0 and pool["active_blocks"] == 0 and pool["entitled_blocks"] == 0, pool
    assert pool["open_copy_orders"] == 0 and pool["pinned_blocks"] == 0, pool
    assert all(v == 2 for k, v in pool.items() if k.endswith("_live_free")), pool
    assert pool["restore_copies_failed"] >= failed  # one failed order per bounded group of each failed restore


@pytest.mark.parametrize("model", ["hybrid", "swa"])
def test_a_handoff_whose_adoption_copies_fail_is_recomputed_on_the_decode_side(model: str) -> None:
    """A P/D consumer (here the producer's own engine, same fingerprint) adopts the padded chain: RESTORE copies of
    the bounded state and the PRIVATIZE copy of the padded page both fail. The consumer recomputes the committed
    prompt itself; its anchor (already in its output) is not repeated and the tokens equal a single-engine run."""
    prompt = list(range(3, 48))  # 45 tokens: the last page is padded
    with _topo("no_cache", model, 128) as t:
        want = Engine(t.model, t.store, max_batch=2, chunk_tokens=48, prefix_cache=False).run(
            [Request.make("x", prompt, 6)])[0].output
    with _topo("kvproc", model, 48) as t:
        eng = Engine(t.model, t.store, max_batch=2, chunk_tokens=48, checkpoint_every_pages=2)
        (prod,) = eng.run([Request.make("p", prompt, 1, handoff_out=True)])
        assert prod.envelope is not None and prod.failed is None
        t.store.flush_saves(0, 10)
        fake = _inject(t.store)
        (dec,) = eng.run([Request.make("d", prompt, 6, handoff_in=prod.envelope)])
        t.store.flush_saves(0, 10)
        pool = t.store.pools[0].stats()
        assert fake.failed_restores == 1 and eng.counters["restore_failed_recomputed"] == 1
        assert eng.counters["handoffs_adopted"] == 1  # adopted, then the copies failed and it was recomputed
        assert dec.failed is None and dec.output == want, (dec.output, want)
        assert pool["admitted_requests"] == pool["active_blocks"] == pool["entitled_blocks"] == 0, pool
        assert pool["open_copy_orders"] == 0 and pool["privatize_copies_failed"] > 0, pool
