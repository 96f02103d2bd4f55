"""`kvproc bench sglang` runs end to end on a few pages (kvproc and SGLang's file backend; Mooncake is the bench's
own optional column) and checks every backend's pages bit for bit: its exit status says so."""

from __future__ import annotations

import pytest

from kvproc.integrations.sglang.bench import main

pytestmark = pytest.mark.timeout(180)


def test_the_bench_runs_and_checks_its_pages(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--pages", "8", "--rounds", "1", "--backends", "kvproc,file"]) == 0
    out = capsys.readouterr().out
    assert "| kvproc |" in out and "| file |" in out and "| NO |" not in out
