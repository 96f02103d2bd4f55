"""The serving layer's retention hint through vLLM (issue 35): a request whose `kv_transfer_params` carry
`{"kvproc_retain_s": R}` ("this conversation comes back within about R seconds") has its pages kept in the host
tier ahead of un-hinted ones (docs/store.md, "Retention hint"; once the request's saves settled, the connector has
each rank's tier re-rank the prefix of its pages it holds, `_retain`: nothing copied, no block kept longer).

A tier of ~64 pages under its default policy (lrfu: every page here is used once, so it ranks them by recency as LRU
would): prompt A (hinted), then C (hinted, with the connector's `_retain` made a no-op: the control), then B (not
hinted), then filler prompts of the tier's whole capacity. Without its hint A would go first (the oldest): C
does, and B after it; A comes back from the tier after vLLM's cache is reset, B and C do not. Bad hints (negative,
not a number, infinite) are refused by name and their requests served.

Three engines (`CASES`): one rank; tensor parallel 2 (both ranks' tiers take the hint); a sliding-window model
(Gemma 3: its window gives back the blocks of the prompt's first pages during the decode; the tier re-ranks those
pages all the same, nothing is read from vLLM's blocks).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import (
    engine,
    generate,
    kvproc_transfer_config,
    live_runtime,
    random_tokens,
    reset_prefix_cache,
)

pytestmark = pytest.mark.timeout(600)

PAGE = 32
PROMPT = 4 * PAGE  # 4 pages each: a hit is 3 of them (vLLM computes the last prompt token itself)
CASES: dict[str, dict[str, Any]] = {
    "one_rank": {},
    "tp2": {"tensor_parallel_size": 2},
    # A 64-token window: after the decode steps below, the first pages' blocks of its sliding group are given back
    "gemma3_sliding": {"builder": "build_tiny_gemma3", "num_gpu_blocks_override": 48},
}
DECODE = 3  # output tokens of the hinted and control prompts: steps after the prefill, where windows slide


def _run(llm: Any, prompt: list[int], retain_s: Any = None, max_tokens: int = 1) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": {"kvproc_retain_s": retain_s}} if retain_s is not None else None
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)


def _loaded(llm: Any, prompt: list[int]) -> int:
    """The tokens kvproc loads for `prompt` asked again."""
    rt = live_runtime()
    before = rt.counters.get("hit_tokens_loaded", 0)
    generate(llm, [prompt], max_tokens=1)
    return rt.counters.get("hit_tokens_loaded", 0) - before


def _settle(llm: Any) -> None:
    """Every move of the run settled: one rank's mover idle; at TP, a few more steps (each rank reports its last
    saves with a step's output, and the scheduler commits them at the next)."""
    rt = live_runtime()
    if rt.moves is not None:
        assert rt.moves.idle(60)
    for _ in range(3):
        generate(llm, [[5, 6, 7]], max_tokens=1)


@pytest.fixture(scope="module", params=sorted(CASES))
def outcome(request: pytest.FixtureRequest, tiny_llama: Path,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, dict[str, int], dict[str, int]]]:
    """One engine per case: A, C (the control), B, the fillers; then what each of A, B, C loads from the tier."""
    from kvproc.integrations.vllm import tiny_models
    from kvproc.integrations.vllm.connector import KvprocConnector

    case = dict(CASES[request.param])
    builder = case.pop("builder", "")
    model = getattr(tiny_models, builder)(tmp_path_factory.mktemp(request.param), tokenizer=False) \
        if builder else tiny_llama
    rng = random.Random(7)
    a, b, c = (random_tokens(rng, PROMPT) for _ in range(3))
    with pytest.MonkeyPatch.context() as mp:
        if case.get("tensor_parallel_size", 1) > 1:
            mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # each rank on a core of its own (one NUMA node)
        with engine(model, kvproc_transfer_config(host_bytes=2 << 20), **case) as llm:
            rt = live_runtime()
            slots = min(r.slots for d in rt.directs for r in d.layout.regions)
            for bad in (-1, "soon", float("inf")):  # refused by name, the request served (and saved, un-hinted)
                _run(llm, random_tokens(rng, PROMPT), retain_s=bad)
            _run(llm, a, retain_s=600, max_tokens=DECODE)
            with pytest.MonkeyPatch.context() as control:  # C: the same hint, its save a no-op
                control.setattr(KvprocConnector, "_retain", lambda self, r: None)
                _run(llm, c, retain_s=600, max_tokens=DECODE)
            _run(llm, b)
            for _ in range(slots // 4 + 1):  # the tier's whole capacity again, in 4-page prompts nobody asks for twice
                generate(llm, [random_tokens(rng, PROMPT)], max_tokens=1)
            _settle(llm)
            assert reset_prefix_cache(llm)
            got = {"a": _loaded(llm, a), "b": _loaded(llm, b), "c": _loaded(llm, c)}
            for rank, d in enumerate(rt.directs):  # every rank's tier took the hint (A's save; C's was never sent)
                got[f"tier{rank}_hinted_saves"] = rt.store.submit(d.tier.stats()).result(30).get(
                    "saves_with_retain_hint", 0)
            yield request.param, got, dict(rt.counters)


def test_a_hinted_prompt_outlives_newer_unhinted_ones(outcome: tuple[str, dict[str, int], dict[str, int]]) -> None:
    case, got, c = outcome
    assert c.get("retain_hints_refused") == 3, c
    assert c.get("retain_hint_saves") == 1 and c.get("retain_hint_saves_ok") == 1, c  # A's (C's was a no-op)
    assert not c.get("retain_hints_ignored"), c
    assert got["a"] == PROMPT - PAGE, (case, got, c)  # every page but the last: from the tier
    assert got["b"] == 0, (case, got, c)  # newer, but not hinted: evicted before A
    assert [v for k, v in got.items() if k.startswith("tier")] == [1] * (2 if case == "tp2" else 1), got


def test_control_without_the_hint_save_the_tier_evicts_the_hinted_prompt(
        outcome: tuple[str, dict[str, int], dict[str, int]]) -> None:
    case, got, c = outcome
    assert got["c"] == 0, (case, got, c)  # C carried A's hint; without `_retain` it went as the oldest
