"""One `kvproc up` tier, a real vLLM engine (kvproc's connector, `.venv-vllm`, another process: `vllm_on_tier.py`) and
this SGLang backend with the same model identity.

- The connector's own page format (one arena per layer in vLLM's block layout, kvproc's hash keys) differs from the
  backend's, and so do their fingerprints: the backend is refused at attach, naming the vLLM engine's fingerprint.
- With `page_format="sglang"` the connector keys and lays pages out as the backend does (SGLang's page keys, one row
  per page in SGLang's host layout; `kvproc/integrations/vllm/sglang_format.py`): pages SGLang stored are a hit that
  vLLM loads into its blocks, and pages vLLM computed are a hit SGLang loads into its host pool, byte for byte per
  layer, token and head; a backend in another host layout is still refused by the fingerprint.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from kvproc.integrations.sglang import SglangConfigError
from tests.integrations.sglang.conftest import backend, host_pool, kv_at

pytestmark = pytest.mark.timeout(420)

ROOT = Path(__file__).resolve().parents[3]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
MODEL_ID = "tests/tiny-llama@shared"
PAGE = 32  # vLLM's block size in vllm_on_tier.py
LAYERS, HEADS, HEAD_DIM = 2, 2, 32  # tiny_llama's KV (build_tiny_llama's defaults), float32
TINY_KV: dict[str, Any] = dict(layers=LAYERS, heads=HEADS, head_dim=HEAD_DIM, dtype="float32")
FROM_SGLANG = list(range(200, 300))  # stored by the SGLang backend first: a hit for vLLM
FROM_VLLM = list(range(3, 103))  # computed by vLLM: a hit for SGLang
FULL = 3  # full pages of each 100-token prompt (vLLM computes the last token itself: at most 99 tokens load)


def _vllm(*args: str) -> subprocess.CompletedProcess[str]:
    if not VLLM_PY.exists():  # `make test` builds it; `make test-sglang` alone may not have
        pytest.skip(f"no {VLLM_PY} (make venv-vllm)")
    run = subprocess.run([str(VLLM_PY), str(Path(__file__).with_name("vllm_on_tier.py")), *args],
                         capture_output=True, text=True, timeout=360, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    return run


def test_a_vllm_engines_tier_refuses_the_sglang_backend_by_fingerprint(shared_tier: str) -> None:
    run = _vllm(shared_tier, MODEL_ID)
    (vllm_fp,) = [ln.split(" ", 1)[1] for ln in run.stdout.splitlines() if ln.startswith("FINGERPRINT ")]
    assert f"id={MODEL_ID}" in vllm_fp
    with pytest.raises(SglangConfigError, match="refused") as e:
        with backend(host_pool(), tier_runtime_dir=shared_tier, model_id=MODEL_ID):
            pass
    assert vllm_fp in str(e.value) and f"id={MODEL_ID}" in str(e.value).split("refused", 1)[1]


def _sglang_keys(tokens: list[int]) -> list[str]:
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return get_storage_hash_str(RadixKey(tokens), None, page_size=PAGE)[:FULL]


def _pages(first_page: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + FULL) * PAGE)


def _assert_same_kv(vllm_blocks: list[np.ndarray], pool: Any, first_page: int) -> None:
    """vLLM's blocks (per layer [pages, block bytes]: [kv heads][K, V][tokens][head dim]) hold, page by page, the
    K and V of every layer, token and head that the SGLang pool holds from `first_page` on."""
    for layer, blocks in enumerate(vllm_blocks):
        per = blocks.view(np.float32).reshape(FULL, HEADS, 2, PAGE, HEAD_DIM)
        for p in range(FULL):
            for t in range(PAGE):
                k, v = kv_at(pool, layer, (first_page + p) * PAGE + t)
                assert np.array_equal(per[p, :, 0, t].view(np.uint8), k.numpy().view(np.uint8)), (layer, p, t)
                assert np.array_equal(per[p, :, 1, t].view(np.uint8), v.numpy().view(np.uint8)), (layer, p, t)


def test_sglang_and_vllm_hit_each_others_pages_in_one_layout(shared_tier: str, tmp_path: Path) -> None:
    pool = host_pool(layout="page_first", tokens=8 * PAGE, page=PAGE, **TINY_KV)
    # floats SGLang "computed" (vLLM never would: equal bytes in its blocks mean they were loaded from the tier)
    pool.kv_buffer.copy_(torch.randn(pool.kv_buffer.shape, generator=torch.Generator().manual_seed(5)))
    with backend(pool, tier_runtime_dir=shared_tier, model_id=MODEL_ID) as b:  # the first to attach: its format
        assert b.batch_set_v1(_sglang_keys(FROM_SGLANG), _pages(0)) == [True] * FULL
        out = tmp_path / "vllm.npz"
        _vllm(shared_tier, MODEL_ID, "sglang:page_first", str(out),
              *(",".join(map(str, p)) for p in (FROM_SGLANG, FROM_VLLM)))
        got = np.load(out)
        counters = json.loads(str(got["counters"]))
        assert counters.get("hit_tokens_host") == FULL * PAGE and counters.get("pages_loaded_into_vllm") == FULL, counters
        # SGLang -> vLLM: the pages the backend stored are in vLLM's blocks of the prompt
        _assert_same_kv([got[f"p0.{li}"] for li in range(LAYERS)], pool, 0)
        # vLLM -> SGLang: the pages vLLM computed are a hit, loaded into other pages of the host pool
        keys = _sglang_keys(FROM_VLLM)
        assert b.batch_exists(keys) == FULL
        assert b.batch_get_v1(keys, _pages(4)) == [True] * FULL
        _assert_same_kv([got[f"p1.{li}"] for li in range(LAYERS)], pool, 4)
        # another host layout is another page format: refused by the fingerprint, as any mismatch
        with pytest.raises(SglangConfigError, match="refused"):
            with backend(host_pool(layout="page_first_direct", tokens=8 * PAGE, page=PAGE, **TINY_KV),
                         tier_runtime_dir=shared_tier, model_id=MODEL_ID):
                pass
