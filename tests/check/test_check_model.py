"""`kvproc check` / `kvproc.check_model` (issue 40): the four built-in models (and their TP and no-prefix-caching
variants) pass every proof; a model broken on purpose, one per failure kind, is named by the check with its group,
arena and byte offset; the command prints the table and exits non-zero on a failure, in a real process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvproc import check_model
from kvproc.check import builtins
from kvproc.check.report import CheckReport
from tests.check import broken_models as broken

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]


def _failures(report: CheckReport, check: str) -> list[tuple[str, str, int | None]]:
    return [(f.group, f.arena, f.offset) for f in report.failures if f.check == check]


@pytest.mark.parametrize("factory", ["dense", "mla", "hybrid", "swa", "dense_tp2", "mla_tp2_replicated"])
def test_the_built_in_models_pass_every_proof(factory: str) -> None:
    report = check_model(getattr(builtins, factory)())
    assert report.ok, report.text()
    text = report.text()
    assert "save -> host tier -> load is bit-exact" in text and "P/D:" in text
    assert all(row.cached for row in report.rows)
    if factory == "mla":
        assert "stored layouts applied" in text and "mla.L0.latent=mla-wire-v1" in text
    if factory in ("hybrid", "swa"):
        assert "(through a checkpoint)" in text
    if factory == "mla_tp2_replicated":
        assert "stored once, in one tier, for 2 ranks" in text and "from rank 0's one copy" in text
    if factory == "dense_tp2":
        assert "on each of 2 ranks" in text


def test_a_model_with_prefix_caching_off_says_why_per_group() -> None:
    report = check_model(builtins.mla_mtp_drafter())
    assert report.ok, report.text()
    why = {r.group: r.why for r in report.rows}
    assert not any(r.cached for r in report.rows)
    assert why["drafter"].startswith("neither checkpointable nor optional")
    assert "prefix caching is off" in why["latent"] and "'drafter'" in why["latent"]


def test_a_wrong_repack_is_named_with_its_group_arena_and_byte() -> None:
    report = check_model(broken.wrong_repack())
    assert not report.ok
    assert ("latent", "mla.L0.latent", broken.BAD_BYTE) in _failures(report, "stored layout")
    stride = dict((a.name, a.block_stride) for _, a in broken.wrong_repack().arenas(0))["mla.L0.latent"]
    trips = _failures(report, "host round trip")
    assert trips and all(g == "latent" and off is not None and off % stride == broken.BAD_BYTE for g, _, off in trips)
    assert {g for g, _, _ in _failures(report, "P/D hand-off")} == {"latent"}
    assert not [f for f in report.failures if f.group == "indexer"]  # the indexer's bytes are right


def test_an_undeclared_layout_is_named() -> None:
    report = check_model(broken.undeclared_layout())
    assert [a for _, a, _ in _failures(report, "undeclared layout")] == ["dense.L0.kv", "dense.L1.kv", "dense.L2.kv"]
    assert "declares no stored_layout" in report.text()


def test_a_declared_layout_that_is_not_applied_is_named() -> None:
    report = check_model(broken.not_applied_layout())
    assert [a for _, a, _ in _failures(report, "stored layout")] == ["dense.L0.kv", "dense.L1.kv", "dense.L2.kv"]
    assert "the layout is not applied" in report.text()


def test_a_wrong_sharding_is_named() -> None:
    report = check_model(broken.wrong_sharding())
    assert _failures(report, "sharding")[:1] == [("attn", "dense.L0.kv", 0)]
    assert "declared REPLICATED, but the ranks compute other KV" in report.text()
    assert [f.check for f in report.failures] == ["sharding"]  # random bytes alone would not have told


def _kvproc_check(factory: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvproc", "check", factory], capture_output=True, text=True,
                          timeout=240, cwd=ROOT)


def test_the_command_prints_the_table_and_exits_non_zero_on_a_failure() -> None:
    good = _kvproc_check("kvproc.check.builtins:hybrid")
    assert good.returncode == 0, good.stdout + good.stderr
    assert "linear  bounded  per_rank  yes" in good.stdout and good.stdout.rstrip().endswith("PASS")
    bad = _kvproc_check("tests.check.broken_models:wrong_repack")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "FAIL stored layout: group 'latent', arena 'mla.L0.latent', byte offset 100" in bad.stdout
    missing = _kvproc_check("tests.check.broken_models:no_such_factory")
    assert missing.returncode == 2 and "no_such_factory" in missing.stderr
