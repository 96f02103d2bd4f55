"""`kvproc check --vllm MODEL_DIR` (issue 40): vLLM builds the model (random weights, its config.json only) and the
command prints how kvproc's connector maps each of its KV cache groups, without serving; exit 0 when the connector
takes the model, 1 when it refuses it (the reason and the fix named)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def qwen3_next_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from kvproc.integrations.vllm.tiny_models import build_tiny_qwen3_next

    out = build_tiny_qwen3_next(tmp_path_factory.mktemp("q3n"), tokenizer=False)
    for weights in out.glob("*.safetensors"):  # its config.json is all the check reads
        weights.unlink()
    return out


def _check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvproc", "check", "--vllm", *args], capture_output=True, text=True,
                          timeout=540)


def test_vllms_own_block_size_is_refused_with_the_fix_and_every_group_still_listed(qwen3_next_config: Path) -> None:
    """Qwen3-Next: vLLM sizes the attention block to hold a GDN state page (384 tokens here), not a power of two."""
    got = _check(str(qwen3_next_config), "--dtype", "bfloat16")
    assert got.returncode == 1, got.stderr[-3000:]
    out = got.stdout
    for row in ("mamba0", "mamba1", "mamba2", "full3"):
        assert row in out, out
    assert "contract: REFUSED: vLLM block_size=384" in out and "block_size=512" in out, out


def test_with_a_power_of_two_block_the_hybrid_model_is_taken(qwen3_next_config: Path) -> None:
    got = _check(str(qwen3_next_config), "--dtype", "bfloat16", "--block-size", "512")
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert "contract: ok: pages of 512 tokens; 4 group(s) (1 paged, 3 state)" in got.stdout, got.stdout


def test_a_directory_vllm_cannot_build_exits_2_naming_it(tmp_path: Path) -> None:
    got = _check(str(tmp_path))  # no config.json
    assert got.returncode == 2 and "vLLM could not build" in got.stderr, got.stderr[-3000:]
