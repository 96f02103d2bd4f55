"""vLLM's default scheduling is asynchronous (step N+1 is scheduled while step N runs): the connector must stay
correct there too (a save is reported a step later, a sampled token is known a step later). vLLM's CPU platform
turns async scheduling off; `cpu_async_scheduling` keeps it on (asserted)."""

from __future__ import annotations

from pathlib import Path

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

pytestmark = pytest.mark.timeout(600)


def test_async_scheduling_same_tokens_and_hits_after_reset(tiny_llama: Path,
                                                           reference: list[tuple[list[int], list[int]]],
                                                           cpu_async_scheduling: None) -> None:
    with engine(tiny_llama, kvproc_transfer_config(), async_scheduling=True) as llm:
        assert llm.llm_engine.vllm_config.scheduler_config.async_scheduling is True
        got = multi_turn(llm)
        assert [o for _, o in got] == [o for _, o in reference]
        assert live_runtime().counters.get("pages_saved_from_vllm", 0) > 0
        assert reset_prefix_cache(llm)
        before = metrics(llm)
        outs = generate(llm, [p for p, _ in reference[-4:]])
        assert outs == [o for _, o in reference[-4:]]
        assert metrics(llm)["vllm:external_prefix_cache_hits"] > before["vllm:external_prefix_cache_hits"]
