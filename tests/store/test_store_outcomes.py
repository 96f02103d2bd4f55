"""`Outcomes`: every terminal state kept with its request id; a request's outcomes found in the whole history or in
its newest part only."""

from __future__ import annotations

from kvproc.store.types import Outcomes


def test_for_request_finds_a_requests_outcomes_oldest_first_in_the_whole_history_or_the_newest_part() -> None:
    out = Outcomes(keep=100)
    out.record("load", "a", "ok", "verified")
    for i in range(20):
        out.record("save", f"s{i}", "ok")
    out.record("load", "b", "ok", "verified_partial")
    out.record("load", "b", "ok")
    out.record("resolve", "b", "ok")
    assert [o.reason for o in out.for_request("b", "load")] == ["verified_partial", ""]
    assert [o.reason for o in out.for_request("b", "load", last=3)] == ["verified_partial", ""]  # same order
    assert [o.reason for o in out.for_request("b", "load", last=2)] == [""]  # only the newest two are searched
    assert [o.op for o in out.for_request("b", last=8)] == ["load", "load", "resolve"]
    assert out.for_request("a", last=8) == [] and len(out.for_request("a")) == 1  # "a" is older than the last 8
    assert out.counts["save.ok"] == 20 and out.counts["load.ok.verified_partial"] == 1
