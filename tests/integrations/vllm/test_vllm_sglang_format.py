"""The connector with `page_format="sglang"`: pages keyed by SGLang's page keys and stored as one row per page in an
SGLang host layout (`kvproc/integrations/vllm/sglang_format.py`), repacked on every copy. A real vLLM engine serves the
multi-turn workload with greedy tokens equal to vLLM alone's, and a replay after its own cache was reset is loaded
from the host tier through the repack (a wrong gather or scatter changes the tokens). That the rows are SGLang's own
pages, and that an SGLang backend on the same tier hits them, is tested in `.venv-sglang`
(tests/integrations/sglang/test_sglang_vllm_tier.py, test_sglang_vllm_format.py).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any, Iterator

import pytest

from kvproc import KvContractError
from kvproc.integrations.vllm.runtime import RuntimeOptions
from kvproc.integrations.vllm.sglang_format import SglangPages
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
def sgl_llm(tiny_llama: Path, reference: Any) -> Iterator[Any]:
    with engine(tiny_llama, kvproc_transfer_config(page_format="sglang", sglang_layout="page_head")) as llm:
        yield llm


def test_multi_turn_tokens_equal_vllm_alone_in_sglangs_page_format(
        sgl_llm: Any, reference: list[tuple[list[int], list[int]]]) -> None:
    got = multi_turn(sgl_llm)
    assert [o for _, o in got] == [o for _, o in reference]
    rt = live_runtime()
    assert rt.model.arena_name == "sglang.mha.page_head.float32.parts"  # the SGLang backend's tier model
    assert rt.counters.get("pages_saved_from_vllm", 0) > 0


def test_a_replay_is_loaded_from_the_tier_through_the_repack(
        sgl_llm: Any, reference: list[tuple[list[int], list[int]]]) -> None:
    last_turn = reference[-4:]
    rng = random.Random(11)
    generate(sgl_llm, [random_tokens(rng, 220) for _ in range(6)], max_tokens=4)
    assert reset_prefix_cache(sgl_llm), "vLLM refused to reset its prefix cache (blocks still in use)"
    rt = live_runtime()
    before, c0 = metrics(sgl_llm), dict(rt.counters)
    outs = generate(sgl_llm, [p for p, _ in last_turn])
    after, c1 = metrics(sgl_llm), dict(rt.counters)
    assert outs == [o for _, o in last_turn]
    ext = after["vllm:external_prefix_cache_hits"] - before["vllm:external_prefix_cache_hits"]
    assert ext > 0 and c1.get("hit_tokens_loaded", 0) - c0.get("hit_tokens_loaded", 0) == ext
    assert c1.get("pages_loaded_into_vllm", 0) - c0.get("pages_loaded_into_vllm", 0) == ext // 32


def test_the_option_is_refused_where_it_cannot_serve() -> None:
    with pytest.raises(ValueError, match="page_format must be"):
        RuntimeOptions.from_extra({"page_format": "sgl"})
    layers = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
    with pytest.raises(KvContractError, match="sglang_layout must be one of"):
        SglangPages.for_vllm("page_unified", layers, 2, 32, 32, 4, "float32", 32)
    with pytest.raises(KvContractError, match="head sizes differ"):
        SglangPages.for_vllm("page_first", layers, 2, 32, 16, 4, "float32", 32)
    with pytest.raises(KvContractError, match="not layers"):
        SglangPages.for_vllm("page_first", layers[1:], 2, 32, 32, 4, "float32", 32)
