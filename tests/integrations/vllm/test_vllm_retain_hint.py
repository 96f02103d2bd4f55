"""The serving layer's retention hint through vLLM (issue 35): a request whose `kv_transfer_params` carry
`{"kvproc_retain_s": R}` ("this conversation comes back within about R seconds") has its pages kept in the host
tier ahead of un-hinted ones (docs/store.md, "Retention hint"; the connector applies it with one more save of the
request's pages at its end, `_plan_retain_save`).

A tier of ~64 pages under its default policy (lrfu: every page here is used once, so it ranks them by recency as LRU
would): prompt A (hinted) then prompt B (not), then filler prompts of the tier's whole capacity. Without the hint A
goes first (the oldest); with the hint B and the oldest fillers go, and A comes back
from the tier after vLLM's cache is reset, B does not. The control (the connector's hint save a no-op) evicts A.
Bad hints (negative, not a number, infinite) are refused by name and their requests served.
"""

from __future__ import annotations

import random
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


def _run(llm: Any, prompt: list[int], retain_s: Any = None) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": {"kvproc_retain_s": retain_s}} if retain_s is not None else None
    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, extra_args=extra)
    llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)


def _loaded(llm: Any, prompt: list[int]) -> int:
    """The tokens kvproc loads for `prompt` asked again."""
    rt = live_runtime()
    before = rt.counters.get("hit_tokens_loaded", 0)
    generate(llm, [prompt], max_tokens=1)
    return rt.counters.get("hit_tokens_loaded", 0) - before


def _a_and_b_after_fillers(tiny_llama: Path) -> tuple[int, int, dict[str, int]]:
    rng = random.Random(7)
    a, b = random_tokens(rng, PROMPT), random_tokens(rng, PROMPT)
    with engine(tiny_llama, kvproc_transfer_config(host_bytes=2 << 20)) as llm:
        rt = live_runtime()
        slots = min(r.slots for r in rt.cluster.host_layout.regions)
        for bad in (-1, "soon", float("inf")):  # refused by name, the request served (and saved, un-hinted)
            _run(llm, random_tokens(rng, PROMPT), retain_s=bad)
        _run(llm, a, retain_s=600)
        _run(llm, b)
        for _ in range(slots // 4 + 1):  # the tier's whole capacity again, in 4-page prompts nobody asks for twice
            generate(llm, [random_tokens(rng, PROMPT)], max_tokens=1)
        assert rt.moves is not None and rt.moves.idle(60)
        assert reset_prefix_cache(llm)
        got_a, got_b = _loaded(llm, a), _loaded(llm, b)
        return got_a, got_b, dict(rt.counters)


def test_a_hinted_prompt_outlives_a_newer_unhinted_one(tiny_llama: Path) -> None:
    got_a, got_b, c = _a_and_b_after_fillers(tiny_llama)
    assert c.get("retain_hint_saves") == 1 and c.get("retain_hint_saves_ok") == 1, c
    assert c.get("retain_hints_refused") == 3, c
    assert got_a == PROMPT - PAGE, (got_a, got_b, c)  # every page but the last: from the tier
    assert got_b == 0, (got_a, got_b, c)  # newer, but not hinted: evicted before A


def test_control_without_the_hint_save_lru_evicts_the_older_prompt(tiny_llama: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from kvproc.integrations.vllm.connector import KvprocConnector

    monkeypatch.setattr(KvprocConnector, "_plan_retain_save", lambda self, r: None)
    got_a, _, c = _a_and_b_after_fillers(tiny_llama)
    assert got_a == 0, (got_a, c)  # the check above fails here: A went first, as LRU's oldest
