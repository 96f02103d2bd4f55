"""P/D with vLLM's asynchronous scheduling (its default: step N+1 is scheduled while step N runs) on both engines:
the producer's anchor is known a step later, the consumer's hand-off load is planned a step ahead. vLLM's CPU
platform turns async scheduling off; `cpu_async_scheduling` keeps it on (asserted)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.integrations.vllm.conftest import engine, generate, live_runtime, random_tokens
from tests.integrations.vllm.test_vllm_pd import _decode_handoffs, _envelopes, _pd_config, _run

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 12
LENGTHS = [70, 96, 45]


def test_pd_with_async_scheduling_gives_the_tokens_of_one_engine(tiny_llama: Path, shared_tier: str,
                                                                 cpu_async_scheduling: None) -> None:
    rng = random.Random(41)
    prompts = [random_tokens(rng, n) for n in LENGTHS]
    with engine(tiny_llama) as llm:
        want = generate(llm, prompts, MAX_TOKENS)
    with engine(tiny_llama, _pd_config("kv_producer", shared_tier), async_scheduling=True) as llm:
        assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling is True
        handed = [_run(llm, p, 1) for p in prompts]
        assert live_runtime().counters.get("handoffs_made") == len(prompts)
    envs = _envelopes(prompts, handed, want)
    with engine(tiny_llama, _pd_config("kv_consumer", shared_tier), async_scheduling=True) as llm:
        assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling is True
        _decode_handoffs(llm, prompts, envs, want, MAX_TOKENS)
