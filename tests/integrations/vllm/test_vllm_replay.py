"""`kvproc bench replay --vs-vllm`: vLLM's KVCacheManager replays the same trace in the same run (in this venv's Python,
a child process) and reaches the same hit ratio at unbounded capacity."""

import json

import pytest

from kvproc.bench.replay import DEFAULT_TRACE, main


@pytest.mark.skipif(not DEFAULT_TRACE.exists(), reason="the conversation trace is not in ../shared/traces")
def test_vs_vllm_same_trace_same_hit_ratio(tmp_path):
    out = tmp_path / "v.json"
    assert main(["--limit", "40", "--vs-vllm", "--hash", "sha256-128", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    assert got["vllm"]["requests"] == got["requests"] == 40
    assert got["vllm"]["token_hit_ratio"] == pytest.approx(got["token_hit_ratio"])
    assert got["token_hit_ratio"] > 0  # the first 40 requests do share prefixes
    assert got["vs_vllm"] > 0
