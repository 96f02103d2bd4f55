"""`kvproc bench copy` runs end to end on tiny batches (no timing assertions: benchmarks are not tests)."""

import json

from kvproc.bench.copybench import main


def test_copy_bench_runs_and_writes_the_documented_json(tmp_path):
    out, png = tmp_path / "copy.json", tmp_path / "copy.png"
    assert main(["--quick", "--json", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000  # --plot
    rows = json.loads(out.read_text())["results"]
    assert {r["op"] for r in rows} == {"save", "load"}
    assert {r["layout"] for r in rows} == {"contiguous", "scattered", "scattered, numpy"}  # numpy: the A/B path
    assert {r["block_bytes"] for r in rows if r["layout"] == "scattered, numpy"} == {4096, 65536}
    for r in rows:
        assert set(r) == {"op", "block_bytes", "layout", "gbps", "memcpy_gbps", "ratio_vs_memcpy"}
