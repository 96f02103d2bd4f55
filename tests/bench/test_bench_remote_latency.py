"""`kvproc bench remote --latency` runs end to end on a real loopback Mooncake: every prompt is a remote hit first
(pulled through node B's host tier), then a host hit of the same pages (no timing asserted)."""

from __future__ import annotations

import pytest

from kvproc.bench.remote_latency import run_latency
from tests.conftest import MooncakeNamespace

pytestmark = pytest.mark.timeout(120)


def test_each_prompt_is_pulled_once_then_hit_in_the_host_tier(mooncake: MooncakeNamespace) -> None:
    row = run_latency(mooncake, prompts=2, prompt_tokens=64)
    assert row["hit_pages"] == 3 and row["pulls_ok"] == 2 and row["pulled_pages"] == 6, row
    assert row["remote_ms_p50"] > 0 and row["host_ms_p50"] > 0
