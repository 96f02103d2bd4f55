"""`kvproc demo --ranks 2`: every run (no cache, device only, kvproc; store processes per rank) gives the tokens of
`--ranks 1`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvproc.demo.single import main

pytestmark = pytest.mark.timeout(600)
ARGS = ["--model", "dense", "--scale", "0.05", "--conversations", "4", "--turns", "2", "--concurrency", "2",
        "--no-progress"]


def test_demo_ranks_2_outputs_match_ranks_1_and_no_cache(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    one, two = tmp_path / "r1.json", tmp_path / "r2.json"
    assert main([*ARGS, "--runs", "kvproc", "--json", str(one)]) == 0
    assert main([*ARGS, "--ranks", "2", "--json", str(two)]) == 0
    r1, r2 = json.loads(one.read_text()), json.loads(two.read_text())
    assert r2["ranks"] == 2 and r2["outputs_identical"] is True  # no_cache, device_only, kvproc at 2 ranks agree
    assert set(r2["outputs_digest"].values()) == {r1["outputs_digest"]["kvproc"]}  # ... and match one rank
    for run in r2["runs"].values():
        assert run["turns_completed"] == 8 and run["turns_failed"] == 0
    assert r2["runs"]["kvproc"]["host_hit_tokens"] == r1["runs"]["kvproc"]["host_hit_tokens"]
    stats = r2["stats"]["kvproc"]["store"]
    assert "tier1" in stats and stats["tier1"]["entries"] == stats["tier"]["entries"] > 0  # a tier per rank
    assert "x 2 ranks" in capsys.readouterr().out


def test_demo_refuses_ranks_with_pd_and_below_one(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main([*ARGS, "--ranks", "0"]) == 2
    assert main([*ARGS, "--ranks", "2", "--pd"]) == 2
    assert "--ranks must be >= 1" in capsys.readouterr().err


def test_demo_copy_mover_torch_runs_the_gpu_paths_batch_logic_with_the_same_outputs(tmp_path: Path) -> None:
    """`--copy-mover torch`: the copy workers move the CPU arenas with the torch rows mover (the GPU path's batch
    logic and executor); every run's tokens are the memmove run's, and the workers' counters name the mover."""
    base, torch_run = tmp_path / "memmove.json", tmp_path / "torch.json"
    assert main([*ARGS, "--runs", "kvproc", "--json", str(base)]) == 0
    assert main([*ARGS, "--copy-mover", "torch", "--json", str(torch_run)]) == 0
    b, t = json.loads(base.read_text()), json.loads(torch_run.read_text())
    assert t["copy_mover"] == "torch" and t["outputs_identical"] is True
    assert t["outputs_digest"]["kvproc"] == b["outputs_digest"]["kvproc"]
    # every copy the workers ran went through the asked mover (saves and device copies: seals and checkpoints)
    assert set(t["stats"]["kvproc"]["copy_movers"]) == {"torch"} and t["stats"]["kvproc"]["copy_movers"]["torch"] > 0
    assert set(b["stats"]["kvproc"]["copy_movers"]) == {"memmove"}  # the default on CPU


def test_demo_refuses_a_copy_mover_it_cannot_use(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main([*ARGS, "--copy-mover", "cuda_mapped"]) == 2  # GPU arenas only
    assert main([*ARGS, "--copy-mover", "torch", "--in-process"]) == 2  # no copy workers to give it to
    err = capsys.readouterr().err
    assert "needs --device cuda" in err and "not --in-process" in err
