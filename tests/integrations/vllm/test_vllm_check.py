"""`kvproc check --vllm MODEL_DIR` (issue 40): vLLM builds the model (random weights, its config.json only) and the
command prints how kvproc's connector maps each of its KV cache groups, without serving; exit 0 when the connector
takes the model, 1 when it refuses it (the reason and the fix named)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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


@pytest.fixture(scope="module")
def checks(qwen3_next_config: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Future[
        subprocess.CompletedProcess[str]]]]:
    """The module's three `kvproc check` runs, started together: each is a process of its own spending ~8 s on one
    core importing vLLM and building the model, so two cores run the three in about half their serial time. Each
    test waits for its own."""
    runs = {"vllm_block": (str(qwen3_next_config), "--dtype", "bfloat16"),
            "power_of_two_block": (str(qwen3_next_config), "--dtype", "bfloat16", "--block-size", "512"),
            "no_config": (str(tmp_path_factory.mktemp("empty")),)}  # no config.json
    with ThreadPoolExecutor(len(runs)) as pool:
        yield {name: pool.submit(_check, *args) for name, args in runs.items()}


def test_vllms_own_block_size_is_refused_with_the_fix_and_every_group_still_listed(
        checks: dict[str, Future[subprocess.CompletedProcess[str]]]) -> None:
    """Qwen3-Next: vLLM sizes the attention block to hold a GDN state page (384 tokens here), not a power of two."""
    got = checks["vllm_block"].result()
    assert got.returncode == 1, got.stderr[-3000:]
    out = got.stdout
    for row in ("mamba0", "mamba1", "mamba2", "full3"):
        assert row in out, out
    assert "contract: REFUSED: vLLM block_size=384" in out and "block_size=512" in out, out


def test_with_a_power_of_two_block_the_hybrid_model_is_taken(
        checks: dict[str, Future[subprocess.CompletedProcess[str]]]) -> None:
    got = checks["power_of_two_block"].result()
    assert got.returncode == 0, got.stdout[-3000:] + got.stderr[-3000:]
    assert "contract: ok: pages of 512 tokens; 4 group(s) (1 paged, 3 state)" in got.stdout, got.stdout


def test_a_directory_vllm_cannot_build_exits_2_naming_it(
        checks: dict[str, Future[subprocess.CompletedProcess[str]]]) -> None:
    got = checks["no_config"].result()
    assert got.returncode == 2 and "vLLM could not build" in got.stderr, got.stderr[-3000:]
