"""Preemption: more running requests than vLLM's cache holds, so vLLM preempts (frees a request's blocks, recomputes
it later). A preempted request's save still in flight is waited for before vLLM reuses its blocks; on resume vLLM's own
prefix cache still has most of its freed blocks (the most recently freed are evicted last). The tokens must still be
vLLM alone's."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.integrations.vllm.conftest import (
    engine,
    generate,
    kvproc_transfer_config,
    live_runtime,
    metrics,
    random_tokens,
)

pytestmark = pytest.mark.timeout(600)


def test_preempted_requests_resume_with_the_same_tokens(tiny_llama: Path) -> None:
    rng = random.Random(5)
    prompts = [random_tokens(rng, 300) for _ in range(4)]  # 4 x (300 + 64) tokens: ~48 blocks, vLLM has 24
    kw = dict(max_num_seqs=4)
    with engine(tiny_llama, **kw) as llm:
        expect = generate(llm, prompts, max_tokens=64)
    with engine(tiny_llama, kvproc_transfer_config(), **kw) as llm:
        got = generate(llm, prompts, max_tokens=64)
        m = metrics(llm)
        counters = dict(live_runtime().counters)
    assert m.get("vllm:num_preemptions", 0) > 0, "the workload did not make vLLM preempt: the test proves nothing"
    assert got == expect
    assert counters.get("pages_saved_from_vllm", 0) > 0
