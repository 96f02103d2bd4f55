"""`kvproc bench replay --vs-vllm` and `--eviction`: vLLM's KVCacheManager on the same trace in the same run reaches
the same hit ratio at unbounded capacity; the replay runs under every eviction policy."""

import json
import math
import subprocess
from pathlib import Path

import pytest

from kvproc.bench.replay import DEFAULT_TRACE, load_trace, main, replay
from kvproc.core.eviction import POLICIES

TINY = Path(__file__).parent.parent / "data" / "trace_tiny.jsonl"
VLLM_PY = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "python"


def _vllm_ok() -> bool:
    if not VLLM_PY.exists():
        return False
    return subprocess.run([str(VLLM_PY), "-c", "import vllm.v1.core.kv_cache_manager"], capture_output=True,
                          timeout=300).returncode == 0


@pytest.mark.parametrize("eviction", POLICIES)
def test_replay_under_every_policy_matches_the_hand_computed_ratios(eviction):
    r = replay(load_trace(TINY), page_tokens=512, device_tokens=math.inf, eviction=eviction)
    assert r.token_hit_ratio == pytest.approx(3072 / 5600)
    # the smallest pool (4 pages) with a host tier behind it: whatever the device evicts, the host serves
    r = replay(load_trace(TINY), page_tokens=512, device_tokens=1, host_tokens=math.inf, eviction=eviction)
    assert r.block_hit_ratio == pytest.approx(6 / 12)


@pytest.mark.skipif(not DEFAULT_TRACE.exists(), reason="the conversation trace is not in ../shared/traces")
def test_vs_vllm_same_trace_same_hit_ratio(tmp_path):
    if not _vllm_ok():
        pytest.skip(".venv-vllm with vLLM is not built (make venv-vllm)")
    out = tmp_path / "v.json"
    assert main(["--limit", "40", "--vs-vllm", "--hash", "sha256-128", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["vllm"]["requests"] == got["requests"] == 40
    assert got["vllm"]["token_hit_ratio"] == pytest.approx(got["token_hit_ratio"])
    assert got["token_hit_ratio"] > 0  # the first 40 requests do share prefixes
    assert got["vs_vllm"] > 0
