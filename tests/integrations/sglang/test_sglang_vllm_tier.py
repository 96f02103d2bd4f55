"""One `kvproc up` tier, a real vLLM engine (kvproc's connector, `.venv-vllm`, another process) and this SGLang
backend with the same model identity: their page layouts differ (vLLM: one arena per layer in vLLM's block layout;
SGLang: one row per page in its host layout) and so do their fingerprints, so the backend is refused at attach,
naming the vLLM engine's fingerprint, and the tier keeps serving the fingerprint it was configured for. (Sharing
pages across the two engines where layouts match is not possible yet: docs/sglang.md, "One store, two engines".)"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from kvproc.integrations.sglang import SglangConfigError
from tests.integrations.sglang.conftest import backend, host_pool

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[3]
VLLM_PY = ROOT / ".venv-vllm" / "bin" / "python"
MODEL_ID = "tests/tiny-llama@shared"


def test_a_vllm_engines_tier_refuses_the_sglang_backend_by_fingerprint(shared_tier: str) -> None:
    if not VLLM_PY.exists():  # `make test` builds it; `make test-sglang` alone may not have
        pytest.skip(f"no {VLLM_PY} (make venv-vllm)")
    run = subprocess.run([str(VLLM_PY), str(Path(__file__).with_name("vllm_on_tier.py")), shared_tier, MODEL_ID],
                         capture_output=True, text=True, timeout=240, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-4000:]
    (vllm_fp,) = [ln.split(" ", 1)[1] for ln in run.stdout.splitlines() if ln.startswith("FINGERPRINT ")]
    assert f"id={MODEL_ID}" in vllm_fp
    with pytest.raises(SglangConfigError, match="refused") as e:
        with backend(host_pool(), tier_runtime_dir=shared_tier, model_id=MODEL_ID):
            pass
    assert vllm_fp in str(e.value) and f"id={MODEL_ID}" in str(e.value).split("refused", 1)[1]
