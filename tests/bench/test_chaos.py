"""The chaos run, short (`kvproc bench chaos`, kvproc/bench/chaos.py): 3 engines x 4 threads on one shared `kvproc up`
tier, 30% cancellations, SIGKILL/SIGSTOP of copy workers and SIGSTOP of the tier, every restored byte checked.

Asserted: 0 wrong bytes, no unexpected exception, nothing held after the drain (blocks, pins, parked requests, saves
and loads in flight; the tier's leases, saves, hand-offs and quarantined slots, nothing reclaimed by a TTL, its peer
table back to its size before the engines), no segment of this run left, and every fault recovered. Exceptions,
reported apart and not fixed (`chaos.ttl_bound`, bench/RESULTS.md "Reliability"): after a stall of the tier, a lease
or a save it granted to a call the engine had already given up on is ended by the tier's TTLs, not by the engine; and
a peer it admitted from a Hello read after the stall, on a connection already closed, may stay in its table.

Recovery is asserted here with a generous bound (RECOVERY_BOUND_S), not the bench's 5 s target: a fault's recovery
includes a forkserver fork (a killed worker), the launcher's 0.5 s reconnect attempts (a stalled one) and the engine's
reconnect to the tier, and on a loaded 2-core CI machine each of those can be starved for seconds by the test's own 15
processes and whatever else runs. The 5 s target is the bench's pass condition (`passed()`), measured on the long run
(bench/RESULTS.md, "Reliability").

The control shows the checker can fail: a test-only injector overwrites the tier's page slots mid-run, and the run
must then report wrong bytes.
"""

from __future__ import annotations

import pytest

from kvproc.bench.chaos import TTL_BOUND, Chaos, ChaosConfig, leaks, page_bytes, page_chain, render, ttl_bound

RECOVERY_BOUND_S = 10.0  # 2x the target; the worst seen at load 7-9 on 2 cores was 3.8 s

pytestmark = pytest.mark.timeout(240)


def test_chaos_short_run_serves_no_wrong_byte_leaks_nothing_and_recovers_from_every_fault() -> None:
    # 31 s: three faults (one of each kind), at least 4 s apart (`recovery_target_s` + 1: here it only spaces them),
    # the last one over RECOVERY_BOUND_S before the end (recoveries are looked for up to the end of the run)
    cfg = ChaosConfig(duration_s=31.0, engines=3, threads=4, cancel_fraction=0.3, fault_every_s=2.0, stop_max_s=3.5,
                      recovery_target_s=3.0, tail_s=RECOVERY_BOUND_S, seed=15)
    s = Chaos(cfg, None).run()
    report = render(s)
    assert s["wrong_bytes"] == 0, report
    assert s["errors"] == 0, report
    assert leaks(s) == {}, report
    assert all(k.split(".", 1)[1] in TTL_BOUND + ("peers_over_baseline",) for k in ttl_bound(s)), report
    # the run did what it says: restores from the tier, cancellations at each point, every kind of fault
    assert s["pages_restored"] > 1000 and s["retired"] > 100, report
    assert all(n > 0 for n in s["cancelled"].values()), report
    assert set(s["faults_by_kind"]) == {"kill_worker", "stop_worker", "stop_tier"}, report
    assert any(f["kind"] == "stop_worker" and f["end"] - f["start"] > 3.0 for f in s["faults"]) or any(
        f["kind"] == "stop_tier" and f["end"] - f["start"] > 3.0 for f in s["faults"]), report
    for f in s["faults"]:
        assert f["recovery_s"] is not None and f["recovery_s"] <= RECOVERY_BOUND_S, report
    assert sum(s["worker_restarts"]) >= 1, report


def test_chaos_checker_reports_wrong_bytes_when_the_tier_holds_corrupted_pages() -> None:
    """Control: a TEST-ONLY injector overwrites every page slot of the shared tier at 2 s; restores after that must
    be counted as wrong bytes (and the run as failed), or the zero above would prove nothing."""
    cfg = ChaosConfig(duration_s=5.0, engines=1, threads=2, cancel_fraction=0.0, fault_every_s=0, fault_kinds=(),
                      seed=3, inject_corruption_at_s=2.0)
    s = Chaos(cfg, None).run()
    assert s["wrong_bytes"] > 0 and s["resolves_with_wrong_bytes"] > 0, render(s)
    assert any(w["source"] == "host" and w["holds"] == ["unknown"] for w in s["wrong_pages"]), render(s)
    assert leaks(s) == {}, render(s)


def test_page_bytes_depend_on_the_whole_prefix_and_the_arena() -> None:
    import numpy as np

    a = np.arange(1, 65, dtype=np.int64)
    b = a.copy()
    b[3] += 1  # one token of the first page differs: every page's digest differs
    ca, cb = page_chain(a, 16), page_chain(b, 16)
    assert len(ca) == 4 and all(x != y for x, y in zip(ca, cb))
    assert not np.array_equal(page_bytes(ca[1], 0, 1024), page_bytes(ca[1], 1, 1024))
    assert np.array_equal(page_bytes(ca[1], 0, 1024), page_bytes(ca[1], 0, 1024))
