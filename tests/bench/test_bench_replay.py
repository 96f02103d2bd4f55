"""Trace replay: hit ratios computed the way the trace's paper counts them, checked against hand-computed values."""

import json
import math
from pathlib import Path

import pytest

from kvproc.bench.replay import load_trace, main, replay, synth_tokens
from kvproc.core.hashing import HashAlgorithm

TINY = Path(__file__).parent.parent / "data" / "trace_tiny.jsonl"


def test_equal_block_ids_give_equal_tokens_and_different_ids_differ():
    a, b = synth_tokens((0, 1)), synth_tokens((0, 2))
    assert len(a) == 1024 and (a[:512] == b[:512]).all() and (a[512:] != b[512:]).any()


@pytest.mark.parametrize("page", [16, 512])
def test_infinite_capacity_matches_the_hand_computed_ratios(page):
    # hits: r1 leads with [0,1] seen, r2 with [0], r3 with [0,1,2] -> 6 of 12 blocks;
    # tokens: min(hit*512, input_length) -> (1024 + 512 + 1536) / 5600
    r = replay(load_trace(TINY), page_tokens=page, device_tokens=math.inf, algorithm=HashAlgorithm.XXH3_128)
    assert r.block_hit_ratio == pytest.approx(6 / 12)
    assert r.token_hit_ratio == pytest.approx(3072 / 5600)
    assert r.host_hit_ratio == 0


def test_lru_eviction_at_the_smallest_pool_matches_the_hand_computed_ratios():
    # pool of 4 pages (the largest request): r2 evicts page "2" (the oldest tail), r3 then hits only [0,1]
    r = replay(load_trace(TINY), page_tokens=512, device_tokens=1, algorithm=HashAlgorithm.XXH3_128)
    assert r.effective_device_tokens == 4 * 512
    assert r.block_hit_ratio == pytest.approx(5 / 12)
    assert r.token_hit_ratio == pytest.approx(2560 / 5600)


def test_host_tier_serves_what_the_device_pool_evicted():
    r = replay(load_trace(TINY), page_tokens=512, device_tokens=1, host_tokens=math.inf)
    assert r.block_hit_ratio == pytest.approx(6 / 12)
    assert r.host_hit_ratio == pytest.approx(512 / 5600)  # page "2" of r3 came back from the host


def test_cli_writes_the_documented_json(tmp_path):
    out = tmp_path / "r.json"
    assert main(["--trace", str(TINY), "--page-tokens", "512", "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    for key in ("requests", "block_hit_ratio", "token_hit_ratio", "device_hit_ratio", "host_hit_ratio",
                "requests_per_s", "cpu_requests_per_s", "blocks_per_s"):
        assert key in got
    assert got["requests"] == 4


def test_sweep_smoke_writes_a_table_and_a_plot(tmp_path):
    png = tmp_path / "sweep.png"
    assert main(["--trace", str(TINY), "--page-tokens", "512", "--sweep", "--plot", str(png),
                 "--json", str(tmp_path / "s.json")]) == 0
    assert png.stat().st_size > 1000
    rows = json.loads((tmp_path / "s.json").read_text())["sweep"]
    assert len(rows) == 9
