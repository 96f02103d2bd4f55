"""`kvproc bench ipc` runs end to end on a few operations (no timing assertions: benchmarks are not tests)."""

import json

import pytest

from kvproc.bench.ipcbench import main
from kvproc.ipc.segment import list_segments


@pytest.mark.timeout(120)
def test_ipc_bench_runs_and_writes_the_documented_json(tmp_path):
    before = set(list_segments())
    out = tmp_path / "ipc.json"
    assert main(["--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["blocks"] for r in doc["results"]] == [1, 16, 256]
    for r in doc["results"]:
        assert {"blocks", "resolve_us", "raw_rtt_us", "resolve_rtt_overhead"} <= set(r)
        assert r["resolve_us"] > 0 and r["raw_rtt_us"] > 0
    assert doc["resolves_per_s"] > 0
    assert not set(list_segments()) - before  # the bench's cluster and arenas are gone
