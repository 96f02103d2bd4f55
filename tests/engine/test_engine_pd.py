"""P/D hand-off through the store with the reference engine: a prefill engine and a decode engine (each with its own
ClusterStore: copy worker process, arenas in shared memory) share one host tier started with `kvproc up`.

For every model shape the P/D run equals a single-engine run token for token; a fingerprint mismatch is rejected at
intake; a missing page rejects before a slot is taken; a cancelled request's hand-off is revoked.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

from kvproc.engine.engine import Engine
from kvproc.engine.models import build_model
from kvproc.engine.pd import PdRouter
from kvproc.engine.repack import REPACK_PATHS
from kvproc.engine.request import Request
from kvproc.engine.workload import WorkloadSpec, drive
from kvproc.ipc.segment import list_segments
from kvproc.store.build import build_local_store
from kvproc.store.cluster import ClusterStore
from kvproc.store.handoff import FingerprintMismatch, HandoffEnvelope

# Unique to this test process: the segment checks below count by cluster name, and another pytest run on the same
# machine (same /dev/shm) must not be counted.
PDENG_CLUSTER = f"pdeng{os.getpid()}"

SPEC = WorkloadSpec(conversations=2, turns=2, first_input=45, new_per_turn=20, output_per_turn=6, concurrency=2)
BLOCKS, LIVE, STAGING, PAGE = 48, 2, 8, 16


def _kvproc_up(cluster: str) -> Iterator[str]:
    rd = f"/tmp/kvup-{cluster}"
    up = subprocess.Popen([sys.executable, "-m", "kvproc", "up", "--cluster", cluster, "--runtime-dir", rd,
                           "--host-mib", "64"], stdout=subprocess.PIPE, text=True)
    try:
        assert up.stdout is not None and "up; manifest" in up.stdout.readline()
        yield rd
    finally:
        subprocess.run([sys.executable, "-m", "kvproc", "down", "--runtime-dir", rd, "--timeout", "10"],
                       check=False, capture_output=True)
        up.wait(10)
    assert not list_segments(cluster)


@pytest.fixture()
def shared_tier() -> Iterator[str]:
    """A fresh `kvproc up` per test: a host tier serves one model shape (its first Configure fixes the layout)."""
    yield from _kvproc_up(PDENG_CLUSTER)


@pytest.fixture(scope="module")
def dense_tier() -> Iterator[str]:
    """One `kvproc up` for the module's single-request dense tests (a tier per model shape; ~1.3 s a start and
    stop): each uses request ids of its own, and what it asserts about the tier is counted from before it ran or
    is about its own engine."""
    yield from _kvproc_up(f"{PDENG_CLUSTER}d")


def engine_on(cs: ClusterStore, name: str, **kw: object) -> Engine:
    model = build_model(name, num_blocks=BLOCKS, num_slots=LIVE + STAGING, page_tokens=PAGE, seed=0,
                        allocator=cs.allocator)
    store = cs.attach_model(model, live_slots=LIVE, repack=REPACK_PATHS.get(name))
    return Engine(model, store, max_batch=LIVE, chunk_tokens=64, checkpoint_every_pages=2, **kw)  # type: ignore[arg-type]


def single_engine_outputs(name: str) -> list[tuple[int, int, tuple[int, ...]]]:
    model = build_model(name, num_blocks=BLOCKS, num_slots=LIVE + STAGING, page_tokens=PAGE, seed=0)
    store = build_local_store(model, live_slots=LIVE, host_bytes=16 << 20)
    try:
        engine = Engine(model, store, max_batch=LIVE, chunk_tokens=64, checkpoint_every_pages=2)
        recs = drive(engine, SPEC, model.vocab_size)
    finally:
        store.close()
    return sorted((r.conversation, r.turn, r.output) for r in recs)


@pytest.mark.parametrize("name", ["dense", "mla", "hybrid", "swa"])
def test_a_pd_run_equals_a_single_engine_run(shared_tier: str, name: str) -> None:
    want = single_engine_outputs(name)
    with ClusterStore.start(16 << 20, tier_runtime_dir=shared_tier) as P, \
            ClusterStore.start(16 << 20, tier_runtime_dir=shared_tier) as D:
        prefill, decode = engine_on(P, name), engine_on(D, name)
        router = PdRouter(prefill, decode)
        recs = drive(router, SPEC, prefill.model.vocab_size)
        assert all(r.failed is None for r in recs), [r.failed for r in recs]
        assert router.counters["handoffs_completed"] == SPEC.total_turns
        assert sorted((r.conversation, r.turn, r.output) for r in recs) == want
        assert decode.counters["handoffs_adopted"] == SPEC.total_turns
        assert sum(r.host_hit_tokens for r in recs) > 0  # later turns' prefill hit what decode sealed
        tier = D.store.stats()["tier"] if D.store else {}
        assert tier["open_handoffs"] == 0 and tier["open_leases"] == 0


def _stall_tier_after_first_turn(runtime_dir: str, seconds: float) -> tuple[object, list[int]]:
    """An `on_turn` hook: SIGSTOP of the shared host tier once the first turn is done, SIGCONT `seconds` later."""
    import signal
    import threading

    from kvproc.runtime import manifest as mf

    (pid,) = [p.pid for p in mf.read_manifest(runtime_dir).processes if p.role == "host_tier"]
    stalls: list[int] = []

    def on_turn(_rec: object) -> None:
        if not stalls:
            stalls.append(pid)
            os.kill(pid, signal.SIGSTOP)
            threading.Timer(seconds, os.kill, (pid, signal.SIGCONT)).start()
    return on_turn, stalls


@pytest.mark.parametrize("short_handoff", ["recompute", "reject"])
def test_pd_through_a_4s_tier_stall_fails_no_turn(shared_tier: str, short_handoff: str) -> None:
    """Issue 39 item 3: the shared tier SIGSTOPped for 4 s under P/D (the stores' heartbeats call it dead; hand-offs
    come short). With the decode side computing what the store did not deliver, every turn completes with one
    engine's tokens. The control (`short_handoff="reject"`, one retry through prefill) fails turns."""
    spec = WorkloadSpec(conversations=4, turns=3, first_input=45, new_per_turn=20, output_per_turn=6, concurrency=2)
    model = build_model("dense", num_blocks=BLOCKS, num_slots=LIVE + STAGING, page_tokens=PAGE, seed=0)
    store = build_local_store(model, live_slots=LIVE, host_bytes=16 << 20)
    try:
        want = sorted((r.conversation, r.turn, r.output) for r in drive(
            Engine(model, store, max_batch=LIVE, chunk_tokens=64, checkpoint_every_pages=2), spec, model.vocab_size))
    finally:
        store.close()
    with ClusterStore.start(16 << 20, tier_runtime_dir=shared_tier) as P, \
            ClusterStore.start(16 << 20, tier_runtime_dir=shared_tier) as D:
        prefill = engine_on(P, "dense", handoff_deadline_s=2.0)
        decode = engine_on(D, "dense", handoff_deadline_s=2.0, short_handoff=short_handoff)
        router = PdRouter(prefill, decode)
        on_turn, stalls = _stall_tier_after_first_turn(shared_tier, 4.0)
        recs = drive(router, spec, model.vocab_size, on_turn=on_turn)
        time.sleep(4.5)  # the tier is running again before the stores close
    assert stalls
    failed = [r for r in recs if r.failed is not None]
    if short_handoff == "reject":
        assert failed, "the control: rejecting short hand-offs fails turns under this stall"
        return
    assert not failed, [r.failed for r in failed]
    assert sorted((r.conversation, r.turn, r.output) for r in recs) == want
    assert router.counters["handoffs_recomputed"] >= 1, router.counters


def test_a_fingerprint_mismatch_is_rejected_at_intake_with_both_strings(dense_tier: str) -> None:
    with ClusterStore.start(16 << 20, tier_runtime_dir=dense_tier) as D:
        decode = engine_on(D, "dense")
        env = HandoffEnvelope("p1", "kvproc-handoff/v1 model=other", committed_len=20, anchor_token_id=5)
        req = Request.make("d1", np.arange(2, 22), 4, handoff_in=env)
        with pytest.raises(FingerprintMismatch) as e:
            decode.submit(req)
        assert env.fingerprint in str(e.value) and decode.fingerprint in str(e.value)


def test_a_missing_page_is_computed_by_the_decode_side_with_the_tokens_of_one_engine(dense_tier: str) -> None:
    """Issue 39 item 3: a hand-off whose pages never reach the store (here: never prefilled; in the chaos run, a
    stalled tier) is a slower turn, not a failed one: the decode engine computes the committed prompt and the anchor
    itself, and its tokens are one engine's over prompt + anchor."""
    prompt = np.arange(2, 42)
    with ClusterStore.start(16 << 20, tier_runtime_dir=dense_tier) as D:
        decode = engine_on(D, "dense", handoff_deadline_s=0.3)
        env = HandoffEnvelope("never-prefilled-2", decode.fingerprint, committed_len=40, anchor_token_id=5)
        req = Request.make("d2r", prompt, 4, handoff_in=env)
        decode.submit(req)
        done: list[Request] = []
        while decode.has_work:
            done += decode.step()
        assert done == [req] and req.failed is None and req.handoff_recomputed == 40
        assert decode.counters["handoffs_recomputed"] == 1 and decode.counters["handoffs_rejected"] == 0
    model = build_model("dense", num_blocks=BLOCKS, num_slots=LIVE + STAGING, page_tokens=PAGE, seed=0)
    store = build_local_store(model, live_slots=LIVE, host_bytes=16 << 20)
    try:
        alone = Request.make("alone", np.concatenate([prompt, [5]]), 3)
        Engine(model, store, max_batch=LIVE, chunk_tokens=64).run([alone])
    finally:
        store.close()
    assert req.output == [5, *alone.output]


def test_a_missing_page_rejects_before_a_slot_is_taken(dense_tier: str) -> None:
    with ClusterStore.start(16 << 20, tier_runtime_dir=dense_tier) as D:
        decode = engine_on(D, "dense", handoff_deadline_s=0.3, short_handoff="reject")
        env = HandoffEnvelope("never-prefilled", decode.fingerprint, committed_len=40, anchor_token_id=5)
        req = Request.make("d2", np.arange(2, 42), 4, handoff_in=env)
        decode.submit(req)
        done: list[Request] = []
        while decode.has_work:
            done += decode.step()
        assert done == [req] and req.failed is not None and "short hit" in req.failed
        assert decode.counters["handoffs_rejected"] == 1 and decode.counters["admitted"] == 0
        assert decode.store.pools[0].stats()["admitted_requests"] == 0


def test_a_cancelled_requests_handoff_entry_is_revoked(dense_tier: str) -> None:
    with ClusterStore.start(16 << 20, tier_runtime_dir=dense_tier) as P:
        prefill = engine_on(P, "dense")
        req = Request.make("p3", np.arange(2, 50), 1, handoff_out=True)
        prefill.run([req])
        assert req.envelope is not None and req.envelope.committed_len == 48
        prefill.store.flush_saves(0)
        assert P.store is not None and P.store.stats()["tier"]["open_handoffs"] >= 1
        before = P.store.stats()["tier"].get("handoffs_revoked", 0)
        prefill.store.revoke_handoff(req.envelope.producer_req_id)  # the client went away: nobody will read it
        deadline = time.monotonic() + 5
        while P.store.stats()["tier"].get("handoffs_revoked", 0) == before and time.monotonic() < deadline:
            time.sleep(0.02)
        tier = P.store.stats()["tier"]
        assert tier["handoffs_revoked"] == before + 1 and tier["open_handoffs"] == 0


def test_killing_the_decode_engine_mid_load_leaves_no_lease_or_segment_behind(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import signal

    import psutil

    from kvproc.engine.pd import EngineProcess, EngineSpec
    from kvproc.ipc import messages as m
    from kvproc.ipc.client import RpcClient
    from kvproc.runtime import manifest as mf

    rd = f"/tmp/kvup-pk{os.getpid()}"
    up = subprocess.Popen([sys.executable, "-m", "kvproc", "up", "--cluster", "pdkill", "--runtime-dir", rd,
                           "--host-mib", "64", "--lease-ttl", "0.5"], stdout=subprocess.PIPE, text=True)
    tier = None
    try:
        assert up.stdout is not None and "up; manifest" in up.stdout.readline()
        tier = RpcClient(f"ipc://{rd}/host_tier-0.sock", token=mf.read_token(rd), peer="tier")
        tier.connect(5)
        with ClusterStore.start(16 << 20, tier_runtime_dir=rd) as P:
            prefill = engine_on(P, "dense")
            req = Request.make("p", np.arange(2, 600), 1, handoff_out=True)
            prefill.run([req])
            assert req.envelope is not None
            decode = EngineProcess(EngineSpec("decode", "dense", BLOCKS * 2, LIVE, STAGING, 16 << 20, rd, PAGE))
            try:
                workers = psutil.Process(decode.proc.pid).children(recursive=True)
                for w in workers:  # hold every load: the decode side's copy worker is stopped
                    w.send_signal(signal.SIGSTOP)
                decode.submit(Request.make("d", np.arange(2, 600), 4, handoff_in=req.envelope))
                deadline = time.monotonic() + 10
                while tier.request(m.TierStats(), timeout=5).counters.get("query_hit", 0) == 0:
                    assert time.monotonic() < deadline, "the decode side never queried the tier"
                    time.sleep(0.05)
                assert tier.request(m.TierStats(), timeout=5).counters["open_leases"] == 1  # mid-load
                os.kill(decode.proc.pid, signal.SIGKILL)
                for w in workers:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        w.send_signal(signal.SIGCONT)
                decode.proc.join(10)
                assert [r.failed for r in decode.step()] == ["engine process died (exit code -9)"]
            finally:
                decode.close()
            psutil.wait_procs(workers, timeout=10)
            assert not [s for s in list_segments() if f".{decode.proc.pid}." in s]
            deadline = time.monotonic() + 10
            while (c := tier.request(m.TierStats(), timeout=5).counters)["open_leases"]:
                assert time.monotonic() < deadline, c
                time.sleep(0.1)
            assert c["leases_reclaimed_by_ttl"] >= 1
    finally:
        if tier is not None:
            tier.close()
        subprocess.run([sys.executable, "-m", "kvproc", "down", "--runtime-dir", rd, "--timeout", "10"],
                       check=False, capture_output=True)
        up.wait(10)


def test_a_handoff_waits_for_a_staging_slot_instead_of_emitting_an_unsatisfiable_envelope() -> None:
    model = build_model("hybrid", num_blocks=BLOCKS, num_slots=2, page_tokens=PAGE, seed=0)  # 1 live + 1 staging
    store = build_local_store(model, live_slots=1, host_bytes=16 << 20)
    try:
        engine = Engine(model, store, max_batch=1, chunk_tokens=64, checkpoint_every_pages=64)
        pool = store.pools[0]
        with pool.lock:
            taken = pool.take_staging_locked("linear")  # the only staging slot, held as if by a save in flight
        assert taken is not None
        req = Request.make("p", np.arange(2, 42), 1, handoff_out=True)
        engine.submit(req)
        for _ in range(20):
            engine.step()
            if engine.counters["handoff_checkpoint_retries"]:
                break
        assert engine.counters["handoff_checkpoint_retries"] == 1 and req.envelope is None
        engine.step()
        assert req.envelope is None  # still waiting: no envelope without its bounded checkpoint
        with pool.lock:
            pool.slabs["linear"].release(taken[0])
        done: list[Request] = []
        while engine.has_work:
            done += engine.step()
        assert done == [req] and req.envelope is not None and req.envelope.committed_len == 40
        store.flush_saves(0)
        stats = store.stats()["tier"]
        assert stats["open_handoffs"] == 1  # the padded chain and its checkpoint are leased for the consumer
    finally:
        store.close()
