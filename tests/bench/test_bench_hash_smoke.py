"""Smoke test of `kvproc bench hash --quick`: it runs, prints its table and writes well-formed JSON. No timing is
asserted (the CI machine is shared); the figures themselves are recorded in bench/RESULTS.md."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvproc.bench import hashbench
from kvproc.core.hashing import HashAlgorithm


def test_hash_bench_quick_prints_table_and_writes_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "hash.json", tmp_path / "hash.png"
    assert hashbench.main(["--quick", "--json", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000  # --plot
    printed = capsys.readouterr().out
    for alg in HashAlgorithm:
        assert alg.value in printed
    assert "vLLM per-page target" in printed and "probe <= hash target" in printed
    data = json.loads(out.read_text())
    assert data["meta"]["quick"] is True
    rows = data["rows"]
    assert {(r["algorithm"], r["tokens"]) for r in rows} == {
        (alg.value, n) for alg in HashAlgorithm for n in hashbench.QUICK_SIZES
    }
    for r in rows:
        assert r["pages"] == r["tokens"] // hashbench.PAGE_TOKENS
        assert r["probe_pages"] == (r["tokens"] - 1) // hashbench.PAGE_TOKENS  # a warm index hits every usable page
        for key in ("hash_us_per_page", "floor_us_per_page", "probe_us_per_page", "cycles_per_s"):
            assert r[key] > 0


def test_hash_bench_is_wired_as_kvproc_bench_hash() -> None:
    cli = pytest.importorskip("kvproc.bench.cli")
    module, _help = cli.BENCHES["hash"]
    assert module == "kvproc.bench.hashbench"
