"""A hybrid Gated-DeltaNet model's prompt of whole pages: the next turn restores from kvproc up to that prompt's end.

vLLM's align mode offers (`boundary_state_offloads`) the states at its checkpoint positions only, which leave a
prompt's last token to recompute: a prompt of exactly n pages gets its states offered up to page n - 1, never at its
own end. The connector takes that state itself in the step after the prompt's last chunk (`_offer_prompt_ends`), so
the next turn (the prompt, its answer and a new user turn) hits all n pages, with the tokens of vLLM alone.
Controls: the connector without `_offer_prompt_ends` hits one page less (the test fails on the hit's depth); one that
takes the next block's state instead (not the state after the prompt) fails on the log-probabilities.
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
    metrics,
    random_tokens,
    reset_prefix_cache,
)

pytestmark = pytest.mark.timeout(900)

PAGE = 512  # the attention block vLLM needs to hold a GDN state page, a power of two for kvproc
ENGINE: dict[str, Any] = {"dtype": "bfloat16", "block_size": PAGE, "max_model_len": 2048,
                          "num_gpu_blocks_override": 48}
MAX_TOKENS = 4  # more than one step: the step after the prefill is where the prompt's end state is taken


def _logprobs(llm: Any, prompt: list[int]) -> tuple[list[int], list[float]]:
    """Greedy tokens and each one's log-probability: a tiny random model's tokens alone can survive a wrong
    recurrent state (a zeroed one gives the same argmax here); its log-probabilities do not."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0].outputs[0]
    toks = list(out.token_ids)
    return toks, [lp[t].logprob for t, lp in zip(toks, out.logprobs)]


def test_next_turn_hits_the_whole_page_aligned_prompt(tmp_path: Path, run_tmpdir: Path) -> None:
    from kvproc.integrations.vllm.tiny_models import build_tiny_qwen3_next

    model = build_tiny_qwen3_next(tmp_path / "qwen3_next", tokenizer=False)
    rng = random.Random(3)
    first = random_tokens(rng, 2 * PAGE)  # ends exactly on a page boundary
    with engine(model, **ENGINE) as llm:  # vLLM alone: the reference
        answer = generate(llm, [first], max_tokens=MAX_TOKENS)[0]
        second = first + answer + random_tokens(rng, 200)  # 2 whole pages, then a partial one
        assert reset_prefix_cache(llm)
        want, want_lp = _logprobs(llm, second)  # a full prefill

    with engine(model, kvproc_transfer_config(), **ENGINE) as llm:
        assert generate(llm, [first], max_tokens=MAX_TOKENS)[0] == answer
        rt = live_runtime()
        # nothing left but kvproc's host tier
        assert rt.moves is not None and rt.moves.idle(60)
        assert reset_prefix_cache(llm), "vLLM refused to reset its prefix cache (blocks still in use)"
        before, c0 = metrics(llm), dict(rt.counters)
        got, got_lp = _logprobs(llm, second)
        after, c1 = metrics(llm), dict(rt.counters)
    ext = after["vllm:external_prefix_cache_hits"] - before["vllm:external_prefix_cache_hits"]
    # the whole first prompt (2 pages) from the tier, its states from the checkpoint at its end (without it: 1 page)
    assert ext == 2 * PAGE, (ext, c1)
    assert c1.get("hit_tokens_loaded", 0) - c0.get("hit_tokens_loaded", 0) == 2 * PAGE
    # the restored state is exactly the one after the prompt's last token: a full prefill's tokens and
    # log-probabilities (equal to the bit here; the state of the next block instead, a control, moves them by 1e-3
    # to 4e-2 and leaves the tokens)
    assert got == want
    assert max(abs(a - b) for a, b in zip(got_lp, want_lp)) <= 1e-4, (got_lp, want_lp)
    assert c1.get("state_prompt_ends_offered", 0) >= 1, c1
