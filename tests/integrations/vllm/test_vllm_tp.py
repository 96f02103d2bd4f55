"""Tensor parallel 2 in a real vLLM-CPU engine with the connector (issue 34): one worker process per rank, each
rank's KV shard saved to and restored from its own host tier, one copy per page each way (`kvproc/integrations/
vllm/tp.py`).

vLLM-CPU runs TP 2 on this 2-core, one-NUMA-node machine only with `VLLM_CPU_OMP_THREADS_BIND="0|1"` (rank 0 on
core 0, rank 1 on core 1; gloo on loopback); its tokens equal TP 1's (`platform-notes.md`). So the reference here is
vLLM alone at TP 1, and the engine under test is vLLM at TP 2 with kvproc.

The control: rank 1's tier slots are zeroed before the replay; the replay then restores rank 1's heads as zeros and
its tokens differ, so the equal tokens of the test are rank 1's restored KV, not a recompute.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


@pytest.fixture(scope="module")
def tp_reference(tiny_llama: Path) -> list[tuple[list[int], list[int]]]:
    with engine(tiny_llama) as llm:
        return multi_turn(llm, **TURNS)


@pytest.fixture
def tp2_env() -> Iterator[None]:
    """Each rank's OpenMP threads on a core of its own (the default binding refuses: one NUMA node)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        yield


def _tier_stats(rt: Any, rank: int) -> dict[str, int]:
    """A rank's host tier's index counters (`pages_saved`: pages committed there)."""
    return rt.store.submit(rt.directs[rank].tier.stats()).result(30)


def _served_then_replayed(llm: Any, reference: list[tuple[list[int], list[int]]],
                          corrupt_rank: int | None = None) -> tuple[list[list[int]], dict[str, Any]]:
    """The workload at TP 2 (its tokens checked), then its last turn again from the host tiers only (vLLM's cache
    reset): the replay's tokens and what it restored."""
    rt = live_runtime()
    assert rt.directs and len(rt.directs) == 2
    assert multi_turn(llm, **TURNS) == reference
    generate(llm, [[5, 6, 7]], 1)  # one more step: the workers report the last saves, the scheduler commits them
    saved = [_tier_stats(rt, r).get("pages_saved", 0) for r in (0, 1)]
    if corrupt_rank is not None:
        for view in rt.directs[corrupt_rank].views.values():
            view[:] = 0
    assert llm.reset_prefix_cache()
    m0, c0 = metrics(llm), dict(rt.counters)
    outs = generate(llm, [p for p, _ in reference[-2:]])
    m1, c1 = metrics(llm), dict(rt.counters)
    return outs, {"saved": saved, "external_hits": m1["vllm:external_prefix_cache_hits"] -
                  m0["vllm:external_prefix_cache_hits"],
                  "host_hits": c1.get("hit_tokens_host", 0) - c0.get("hit_tokens_host", 0)}


def test_tp2_restores_each_ranks_shard_from_its_own_tier_and_tokens_equal_tp1(
        tiny_llama: Path, tp_reference: list[tuple[list[int], list[int]]], tp2_env: None) -> None:
    with engine(tiny_llama, kvproc_transfer_config(), tensor_parallel_size=2) as llm:
        outs, got = _served_then_replayed(llm, tp_reference)
    assert outs == [o for _, o in tp_reference[-2:]]
    assert got["saved"][0] > 0 and got["saved"][0] == got["saved"][1], got  # every page's shard on both ranks
    assert got["external_hits"] > 0 and got["host_hits"] >= got["external_hits"], got


def test_control_a_ranks_zeroed_tier_changes_the_replays_tokens(
        tiny_llama: Path, tp_reference: list[tuple[list[int], list[int]]], tp2_env: None) -> None:
    with engine(tiny_llama, kvproc_transfer_config(), tensor_parallel_size=2) as llm:
        outs, got = _served_then_replayed(llm, tp_reference, corrupt_rank=1)
    assert got["external_hits"] > 0, got
    assert outs != [o for _, o in tp_reference[-2:]]


def test_tp2_refuses_what_it_cannot_carry_by_name() -> None:
    """The parts of the connector that tensor parallel does not carry yet are refused before anything starts."""
    from kvproc import KvContractError
    from kvproc.integrations.vllm.connector import KvprocConnector
    from kvproc.integrations.vllm.runtime import RuntimeOptions

    class _Probe:  # only what `_check_tp` reads: a contract and options (a mock of the connector's own state)
        def __init__(self, options: RuntimeOptions, sliding: bool) -> None:
            self.options, self.ranks = options, 2
            self.contract = type("C", (), {"has_sliding": sliding, "states": [], "groups": []})()

    check = KvprocConnector._check_tp
    check(_Probe(RuntimeOptions(), False), "kv_both")  # type: ignore[arg-type]
    for options, sliding, role, why in [(RuntimeOptions(), False, "kv_producer", "P/D"),
                                        (RuntimeOptions(path="staging"), False, "kv_both", "staging"),
                                        (RuntimeOptions(), True, "kv_both", "sliding window"),
                                        (RuntimeOptions(async_moves=False), False, "kv_both", "async_moves")]:
        with pytest.raises(KvContractError, match=why):
            check(_Probe(options, sliding), role)  # type: ignore[arg-type]

