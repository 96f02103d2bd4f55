"""`kvproc demo` end to end on a tiny workload: three runs, the JSON keys the issue names, a PNG plot."""

from __future__ import annotations

import json
from pathlib import Path

from kvproc.demo.single import main

RUN_KEYS = {"ttft_p50_ms", "ttft_p99_ms", "output_tok_s", "turns_completed", "turns_failed", "prompt_tokens",
            "device_hit_tokens", "host_hit_tokens"}


def test_demo_writes_json_with_three_runs_and_a_plot(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    out, png = tmp_path / "demo.json", tmp_path / "ttft.png"
    rc = main(["--model", "swa", "--scale", "0.05", "--conversations", "4", "--turns", "2", "--concurrency", "2",
               "--no-progress", "--json", str(out), "--plot", str(png)])
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data["runs"]) == {"no_cache", "device_only", "kvproc"}
    for run in data["runs"].values():
        assert RUN_KEYS <= set(run)
        assert run["turns_completed"] == 8 and run["turns_failed"] == 0
    assert isinstance(data["outputs_identical"], bool)
    assert data["runs"]["no_cache"]["device_hit_tokens"] == 0 and data["runs"]["device_only"]["host_hit_tokens"] == 0
    assert png.stat().st_size > 0
    table = capsys.readouterr().out
    assert "TTFT p50" in table and "kvproc" in table
