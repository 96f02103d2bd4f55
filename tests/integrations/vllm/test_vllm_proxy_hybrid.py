"""`kvproc proxy` in front of two real `vllm serve` processes of a hybrid model (a tiny Qwen3-Next: Gated-DeltaNet
state groups + full attention), one shared `kvproc up` tier: the completions, streamed or not, carry vLLM alone's
tokens, and the consumer computes only what the hand-off does not carry (the prompt's tail past its deepest page
boundary, where the producer's state checkpoint is, and the anchor). `test_vllm_proxy.py` covers the proxy itself.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.integrations.vllm.conftest import VLLMPD_CLUSTER, engine, generate, random_tokens
from tests.integrations.vllm.test_vllm_proxy import (
    _body,
    _consumer_counts,
    _post,
    _proxy,
    _stop,
    serving,
)

pytestmark = pytest.mark.timeout(900)

PAGE = 512  # vLLM's block for this model (its state page is 384 tokens; kvproc's page a power of two)
ENGINE = {"dtype": "bfloat16", "block_size": PAGE, "max_model_len": 2048, "num_gpu_blocks_override": 48}
MAX_TOKENS = 8
LENGTHS = (700, 1100)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory: pytest.TempPathFactory, run_tmpdir: Path) -> Path:
    from kvproc.integrations.vllm.tiny_models import build_tiny_qwen3_next

    return build_tiny_qwen3_next(tmp_path_factory.mktemp("qwen3next-serve"))


def test_proxy_serves_a_state_model_with_one_engines_tokens(qwen3_next: Path, run_tmpdir: Path) -> None:
    rng = random.Random(41)
    prompts = [random_tokens(rng, n) for n in LENGTHS]
    with engine(qwen3_next, **ENGINE) as llm:  # vLLM alone, in this process, before the servers start
        want = [generate(llm, [p], MAX_TOKENS)[0] for p in prompts]

    from tests.conftest import kvproc_up

    args = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    with kvproc_up(f"{VLLMPD_CLUSTER}q3n", "--host-mib", "128") as (tier, _), \
            serving(qwen3_next, tier, run_tmpdir, model_args=args) as servers:
        servers.wait_ready()
        proxy, url = _proxy(servers.producer, servers.consumer)
        try:
            hits0, computed0, done0 = _consumer_counts(servers.consumer)
            status, out = _post(url, _body(prompts[0], max_tokens=MAX_TOKENS, return_token_ids=True))
            assert status == 200, out
            assert out["choices"][0]["token_ids"] == want[0]
            status, events = _post(url, _body(prompts[1], max_tokens=MAX_TOKENS, stream=True,
                                              return_token_ids=True))
            assert status == 200
            assert [t for ev in events for ch in ev.get("choices", []) for t in ch.get("token_ids") or []] == want[1]
            hits, computed, done = _consumer_counts(servers.consumer)
            committed = [(n - 1) // PAGE * PAGE for n in LENGTHS]  # 512, 1024: the hand-offs' checkpoints
            assert done - done0 == len(prompts)
            assert hits - hits0 == sum(committed), "the consumer did not load the hand-offs"
            # the tails past the checkpoints and the anchors, nothing more
            assert computed - computed0 == sum(n - c + 1 for n, c in zip(LENGTHS, committed))
        finally:
            _stop(proxy, 10)
