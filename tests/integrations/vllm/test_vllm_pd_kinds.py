"""P/D for the hybrid models (issue 34): prefill on a `kv_producer` vLLM engine, decode on a `kv_consumer` one, one
shared `kvproc up` tier, for a sliding-window + full-attention model (Gemma 3: two KV cache groups) and a
Gated-DeltaNet + attention model (Qwen3-Next: three state groups and one full-attention group).

- Gemma 3: the whole prompt is handed off (its partial last page padded), as for a dense model; the consumer loads
  only the pages inside each sliding layer's window (vLLM gives its null block for the rest).
- Qwen3-Next: vLLM keeps a state only at page boundaries, so the hand-off ends at the prompt's deepest page boundary
  with the states' checkpoint there (a prompt of exactly 1024 tokens: 512, vLLM offers no state at the prompt's own
  end); the consumer loads those pages and the checkpoint and computes the prompt's tail.

Both: the consumer's greedy tokens equal vLLM alone's, it computes no token the hand-off carried, and each group's
pages are loaded (counted by group). The control: one group's copy in the shared tier overwritten with noise between
prefill and decode changes the consumer's tokens (its restored KV is really what vLLM computes with).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from tests.integrations.vllm.conftest import VLLMPD_CLUSTER, engine, generate, live_runtime, random_tokens
from tests.integrations.vllm.test_vllm_pd import _pd_config as _config
from tests.integrations.vllm.test_vllm_pd import _run

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 8


@dataclass(frozen=True)
class PdKind:
    builder: str  # kvproc.integrations.vllm.tiny_models.<builder>
    engine: dict[str, Any]
    lengths: tuple[int, ...]  # prompts checked
    noisy: tuple[int, ...]  # prompts of the control
    noise_group: str  # the kvproc group whose tier copy the control overwrites
    page: int


KINDS = {
    # window 64 over 32-token pages; lengths off and on the page
    "hybrid_gemma3": PdKind("build_tiny_gemma3", {"num_gpu_blocks_override": 48}, (150, 96, 201), (170, 130),
                            "swa0", 32),
    # vLLM's state page is 384 tokens, kvproc's page 512 (a power of two): prompts past one page
    "hybrid_gdn": PdKind("build_tiny_qwen3_next", {"dtype": "bfloat16", "block_size": 512, "max_model_len": 2048,
                                                    "num_gpu_blocks_override": 48}, (700, 1024, 1100), (900,),
                         "mamba0", 512),
}


def _committed(k: PdKind, prompt: list[int]) -> int:
    """What the producer hands off: the whole prompt, or (state groups) up to the deepest page boundary before its
    last token (vLLM offers no state at the prompt's own end: that block's state is never a hit for vLLM)."""
    return len(prompt) if k.builder != "build_tiny_qwen3_next" else (len(prompt) - 1) // k.page * k.page


def _noise(group: str) -> None:
    """Overwrite one group's regions of the shared tier's segment (the hand-offs waiting there) with noise."""
    from kvproc.ipc.segment import Segment

    rt = live_runtime()
    seg = Segment.attach(rt.cluster.host_segment)
    try:
        g = torch.Generator().manual_seed(0)
        for region in rt.cluster.host_layout.regions:
            if region.group == group:
                n = region.slots * region.unit_bytes
                view = seg.torch(torch.uint8, region.offset, n)
                view.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g))
                del view
    finally:
        seg.close()


@pytest.fixture(scope="module", params=sorted(KINDS))
def pd_kind(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
            run_tmpdir: Path) -> Iterator[tuple[str, PdKind, Path, str]]:
    from kvproc.integrations.vllm import tiny_models

    from tests.conftest import kvproc_up

    name = request.param
    k = KINDS[name]
    build: Callable[..., Path] = getattr(tiny_models, k.builder)
    model = build(tmp_path_factory.mktemp(name), tokenizer=False)
    # One tier per model: a tier takes the page format of the first store that configures it.
    with kvproc_up(f"{VLLMPD_CLUSTER}{name[-3:]}", "--host-mib", "128") as (tier, _):
        yield name, k, model, tier


def test_pd_of_a_hybrid_model_gives_one_engines_tokens(pd_kind: tuple[str, PdKind, Path, str]) -> None:
    from kvproc.integrations.vllm.connector import HANDOFF_KEY

    name, k, model, shared_tier = pd_kind
    rng = random.Random(31)
    prompts = [random_tokens(rng, n) for n in k.lengths]
    noisy = [random_tokens(rng, n) for n in k.noisy]
    with engine(model, **k.engine) as llm:  # vLLM alone: the reference
        want = [generate(llm, [p], MAX_TOKENS)[0] for p in prompts + noisy]

    with engine(model, _config("kv_producer", shared_tier), **k.engine) as llm:
        handed = [_run(llm, p, 1) for p in prompts + noisy]
        assert live_runtime().counters.get("handoffs_made") == len(handed)
    envs = [o.kv_transfer_params[HANDOFF_KEY] for o in handed]
    for p, o, env, w in zip(prompts + noisy, handed, envs, want):
        assert list(o.outputs[0].token_ids) == w[:1] == [env["anchor_token_id"]]
        assert env["committed_len"] == _committed(k, p), (len(p), env["committed_len"])

    with engine(model, _config("kv_consumer", shared_tier), **k.engine) as llm:
        rt = live_runtime()
        assert rt.direct is not None, name  # the direct path (one copy a page), the P/D default for every kind
        for p, env, w in zip(prompts, envs, want):
            out = _run(llm, p + [env["anchor_token_id"]], MAX_TOKENS - 1, {HANDOFF_KEY: env})
            assert [env["anchor_token_id"]] + list(out.outputs[0].token_ids) == w, (name, len(p))
            assert out.num_cached_tokens == env["committed_len"], "the consumer computed tokens the hand-off had"
        c = dict(rt.counters)
        assert c.get("handoffs_adopted") == len(prompts), c
        assert c.get("handoff_tokens_loaded") == sum(e["committed_len"] for e in envs[:len(prompts)]), c
        # loads="auto": a model of several KV cache groups loads the hand-off beside vLLM's forwards, one of one group
        # before the forward that reads it
        assert (c.get("loads_async", 0) >= len(prompts)) == (len(rt.contract.groups) > 1), c
        for g in rt.contract.groups:
            loaded = c.get(f"pages_loaded.{g.name}", 0)
            assert loaded > 0, (g.name, c)
            if g.state:
                assert loaded == len(prompts), (g.name, c)  # one checkpoint per hand-off, at its end
        assert rt.store.stats()["tier"]["handoffs_consumed"] == len(prompts)

        # The control: the noisy prompts' hand-offs are overwritten in one group only; their tokens change.
        _noise(k.noise_group)
        got = []
        for p, env in zip(noisy, envs[len(prompts):]):
            out = _run(llm, p + [env["anchor_token_id"]], MAX_TOKENS - 1, {HANDOFF_KEY: env})
            got.append([env["anchor_token_id"]] + list(out.outputs[0].token_ids))
        assert rt.counters.get("handoffs_adopted") == len(prompts) + len(noisy)
        assert got != want[len(prompts):], f"noise in {k.noise_group}'s hand-off pages changed nothing"
