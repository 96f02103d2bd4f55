"""`kvproc bench chaos-pd` (issue 39): P/D through repeated SIGSTOPs of the shared tier fails no turn and gives one
engine's tokens; what the stalls left in the tier is settled. A short run (the bench is run for minutes in
bench/RESULTS.md); its control is `tests/engine/test_engine_pd.py`'s `short_handoff="reject"`, which fails turns."""

from __future__ import annotations

import pytest

from kvproc.bench.chaos_pd import run

pytestmark = pytest.mark.timeout(300)


def test_pd_through_repeated_tier_stalls_fails_no_turn_and_leaves_nothing_open() -> None:
    s = run(duration_s=10.0, model_name="dense", every_s=3.0, stop_s=3.5, seed=1, progress=False)
    assert s.stalls >= 1 and s.turns > 0
    assert s.failed_turns == 0 and s.wrong_outputs == 0, s.failures
    assert s.tier_after["open_leases"] == 0 and s.tier_after["open_saves"] == 0, s.tier_after
    assert s.tier_after["open_handoffs"] == 0, s.tier_after
