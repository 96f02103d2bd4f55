"""P/D through kvproc: prefill on a `kv_producer` vLLM engine, decode on a `kv_consumer` one, the KV handed over
through one shared kvproc host tier (`kvproc up`), real engines and real kvproc processes.

The test is its own proxy: each prompt goes to the producer with max_tokens=1 (its output: the anchor token and
kvproc's envelope in `kv_transfer_params`), then to the consumer as prompt + anchor with the envelope. vLLM keeps one
KV connector per process, so the producer serves every prefill and is shut down before the consumer starts: the
hand-offs wait in the shared tier (leased to the consumer) meanwhile.
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

MAX_TOKENS = 12
LONG_TOKENS = 40
# Lengths off and on vLLM's 32-token block: the padded last page and the aligned case.
LENGTHS = [70, 96, 45, 131]


def _pd_config(role: str, tier: str) -> dict[str, Any]:
    cfg = kvproc_transfer_config(tier_runtime_dir=tier)
    cfg["kv_role"] = role
    return cfg


def _run(llm: Any, prompt: list[int], max_tokens: int, params: dict[str, Any] | None = None) -> Any:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    extra = {"kv_transfer_params": params} if params is not None else None
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, extra_args=extra)
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
    return out


def _envelopes(prompts: list[list[int]], handed: list[Any], want: list[list[int]]) -> list[dict[str, Any]]:
    """The producer's envelopes, each checked: its anchor is the one-engine first token, the whole prompt committed."""
    from kvproc.integrations.vllm.connector import HANDOFF_KEY

    envs = [o.kv_transfer_params[HANDOFF_KEY] for o in handed]
    for p, o, env, w in zip(prompts, handed, envs, want):
        assert list(o.outputs[0].token_ids) == w[:1] == [env["anchor_token_id"]]
        assert env["committed_len"] == len(p)
    return envs


def _decode_handoffs(llm: Any, prompts: list[list[int]], envs: list[dict[str, Any]], want: list[list[int]],
                     max_tokens: int) -> Any:
    """The consumer continues every hand-off from its anchor: one engine's tokens, no prompt token computed, every
    hand-off adopted and its tokens loaded. Returns the consumer's runtime."""
    from kvproc.integrations.vllm.connector import HANDOFF_KEY

    rt = live_runtime()
    for p, env, w in zip(prompts, envs, want):
        out = _run(llm, p + [env["anchor_token_id"]], max_tokens - 1, {HANDOFF_KEY: env})
        assert [env["anchor_token_id"]] + list(out.outputs[0].token_ids) == w
        assert out.num_cached_tokens == len(p), "the consumer computed prompt tokens the producer had"
    assert rt.counters.get("handoffs_adopted") == len(prompts)
    assert rt.counters.get("handoff_tokens_loaded") == sum(len(p) for p in prompts)
    return rt


def test_pd_producer_and_consumer_give_the_tokens_of_one_engine(tiny_llama: Path, shared_tier: str) -> None:
    from kvproc.integrations.vllm.connector import HANDOFF_KEY

    rng = random.Random(23)
    prompts = [random_tokens(rng, n) for n in LENGTHS]
    mismatch = random_tokens(rng, 77)  # handed off, then presented with another engine's fingerprint
    long = random_tokens(rng, 45)  # decoded long enough to fill the padded page and the next one on the consumer
    with engine(tiny_llama) as llm:
        want = generate(llm, prompts + [mismatch], MAX_TOKENS)
        (want_long,) = generate(llm, [long], LONG_TOKENS)

    # Prefill: the producer samples the anchor and returns kvproc's envelope.
    with engine(tiny_llama, _pd_config("kv_producer", shared_tier)) as llm:
        handed = [_run(llm, p, 1) for p in prompts + [mismatch]]
        handed_long = _run(llm, long, 1)
        assert live_runtime().counters.get("handoffs_made") == len(handed) + 1
    envs = _envelopes(prompts + [mismatch], handed, want)

    # Decode: the consumer adopts the hand-off; it computes the anchor and what it generates, no prompt token.
    with engine(tiny_llama, _pd_config("kv_consumer", shared_tier)) as llm:
        rt = _decode_handoffs(llm, prompts, envs, want, MAX_TOKENS)
        tier = rt.store.stats()["tier"]
        assert tier["handoffs_consumed"] == len(prompts)

        # A producer this engine cannot restore (other weights, layout or hashing) is refused: nothing loaded, the
        # consumer computes the whole prompt and still gives the right tokens.
        env = dict(envs[-1], fingerprint=envs[-1]["fingerprint"].replace("page=32", "page=16"))
        out = _run(llm, mismatch + [env["anchor_token_id"]], MAX_TOKENS - 1, {HANDOFF_KEY: env})
        assert [env["anchor_token_id"]] + list(out.outputs[0].token_ids) == want[-1]
        assert out.num_cached_tokens == 0
        assert rt.counters.get("handoffs_refused") == 1
        assert rt.counters.get("handoffs_adopted") == len(prompts)

        # The consumer saves the pages it computes of a hand-off request (the padded page's real rows included):
        # after vLLM forgets them, the whole conversation so far comes back from kvproc, with the right next token.
        env = handed_long.kv_transfer_params[HANDOFF_KEY]
        out = _run(llm, long + [env["anchor_token_id"]], LONG_TOKENS - 1, {HANDOFF_KEY: env})
        got = [env["anchor_token_id"]] + list(out.outputs[0].token_ids)
        assert got == want_long
        assert reset_prefix_cache(llm)
        c0 = dict(rt.counters)
        known = long + got[:-1]  # 45 + 39 tokens: pages 0 (the producer's) and 1 (the padded one, completed here)
        nxt = _run(llm, known, 1)
        assert list(nxt.outputs[0].token_ids) == got[-1:]
        loaded = rt.counters.get("hit_tokens_loaded", 0) - c0.get("hit_tokens_loaded", 0)
        assert loaded >= 2 * 32, f"{loaded} tokens from kvproc: the consumer did not save the pages it computed"
