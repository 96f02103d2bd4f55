"""kvproc as vLLM's host tier, end to end: a real vLLM engine (CPU), real kvproc processes (host tier, copy worker).

One engine without the connector gives the reference tokens; one engine with it serves the same workload. vLLM's own
KV cache (24 blocks of 32 tokens) is smaller than the workload's working set, and filler prompts then a reset of
vLLM's cache before each replay leave the replayed pages in kvproc's host tier only.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from tests.integrations.vllm.conftest import (
    engine,
    generate,
    kvproc_transfer_config,
    live_runtime,
    metrics,
    multi_turn,
    random_tokens,
    reset_prefix_cache,
)

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def kv_llm(tiny_llama: Path, reference: Any) -> Iterator[Any]:
    with engine(tiny_llama, kvproc_transfer_config()) as llm:
        yield llm


def _churn_and_reset(llm: Any, seed: int) -> None:
    """Other prompts' pages into the tier (filler prompts), the replayed pages out of vLLM's cache (reset)."""
    rng = random.Random(seed)
    generate(llm, [random_tokens(rng, 220) for _ in range(6)], max_tokens=4)
    assert reset_prefix_cache(llm), "vLLM refused to reset its prefix cache (blocks still in use)"


def test_multi_turn_tokens_equal_vllm_alone(kv_llm: Any, reference: list[tuple[list[int], list[int]]]) -> None:
    before = metrics(kv_llm)
    got = multi_turn(kv_llm)
    after = metrics(kv_llm)
    assert [o for _, o in got] == [o for _, o in reference]
    # The working set exceeds vLLM's cache: later turns found evicted pages in kvproc.
    assert after["vllm:external_prefix_cache_hits"] > before.get("vllm:external_prefix_cache_hits", 0)
    rt = live_runtime()
    assert rt.counters.get("pages_saved_from_vllm", 0) > 0
    assert rt.store.stats()["outcomes"].get("save.ok", 0) > 0


def test_after_reset_a_repeated_prompt_is_served_from_kvproc(kv_llm: Any,
                                                              reference: list[tuple[list[int], list[int]]]) -> None:
    last_turn = reference[-4:]
    _churn_and_reset(kv_llm, seed=11)
    rt = live_runtime()
    before, c0 = metrics(kv_llm), dict(rt.counters)
    outs = generate(kv_llm, [p for p, _ in last_turn])
    after, c1 = metrics(kv_llm), dict(rt.counters)
    assert outs == [o for _, o in last_turn]
    ext = after["vllm:external_prefix_cache_hits"] - before["vllm:external_prefix_cache_hits"]
    assert ext > 0
    # vLLM's count of external tokens is kvproc's count of tokens it loaded into vLLM's blocks ...
    assert c1.get("hit_tokens_loaded", 0) - c0.get("hit_tokens_loaded", 0) == ext
    # ... and they came from the host tier.
    assert c1.get("hit_tokens_host", 0) - c0.get("hit_tokens_host", 0) > 0


def test_control_corrupted_host_copy_changes_tokens(kv_llm: Any,
                                                    reference: list[tuple[list[int], list[int]]]) -> None:
    """The control that can fail: if the restored KV were not used, corrupting kvproc's host copy would change
    nothing."""
    from kvproc.ipc.segment import Segment

    last_turn = reference[-4:]
    _churn_and_reset(kv_llm, seed=12)
    rt = live_runtime()
    layout = rt.cluster.host_layout
    seg = Segment.attach(rt.cluster.host_segment)
    try:
        g = torch.Generator().manual_seed(0)
        for region in layout.regions:  # the KV bytes only: the slot table stays intact, so loads still verify
            n = region.slots * region.unit_bytes // 4
            view = seg.torch(torch.float32, region.offset, n)
            view.copy_(torch.randn(n, generator=g) * 4)
            del view
    finally:
        seg.close()
    c0 = dict(rt.counters)
    outs = generate(kv_llm, [p for p, _ in last_turn])
    assert rt.counters.get("hit_tokens_host", 0) - c0.get("hit_tokens_host", 0) > 0
    assert outs != [o for _, o in last_turn]
