"""`OpRunner` (every remote call: a deadline and exactly one terminal outcome) and the Mooncake URL (no Mooncake
process needed)."""

from __future__ import annotations

import threading
import time

import pytest

from kvproc.tiers.deadline_ops import CLOSED, FAILED, OK, TIMEOUT, OpRunner
from kvproc.tiers.mooncake import namespace
from kvproc.tiers.mooncake_client import Breaker, RemoteSpec


def test_a_call_past_its_deadline_ends_timeout_and_its_late_result_still_arrives() -> None:
    runner = OpRunner("t")
    release = threading.Event()
    late: list[tuple[str, object]] = []
    got = threading.Event()
    t0 = time.monotonic()
    outcome, _ = runner.call(lambda: release.wait(10) and "done", 0.2,
                             on_late=lambda o, r: (late.append((o, r)), got.set()))
    assert outcome == TIMEOUT and time.monotonic() - t0 < 5  # not the 10 s the call could take
    # A call queued behind the hung one times out too (it never ran: its deadline passed in the queue).
    outcomes: list[str] = []
    runner.submit(lambda: "never", 0.1, lambda o, r: outcomes.append(o))
    deadline = time.monotonic() + 5
    while not outcomes and time.monotonic() < deadline:  # the watchdog ends it while the hung call still runs
        time.sleep(0.01)
    assert outcomes == [TIMEOUT]
    release.set()
    assert got.wait(5) and late == [(OK, "done")]
    assert runner.call(lambda: 7, 1.0) == (OK, 7)
    outcome, err = runner.call(lambda: 1 / 0, 1.0)
    assert outcome == FAILED and isinstance(err, ZeroDivisionError)
    runner.close()
    assert runner.call(lambda: 1, 1.0) == (CLOSED, None)
    assert runner.join(5)
    assert runner.outcomes == {OK: 1, FAILED: 1, TIMEOUT: 2, CLOSED: 1}


def test_remote_url() -> None:
    spec = RemoteSpec.parse("mooncake://127.0.0.1:50051?metadata=http://127.0.0.1:8080/metadata&ns=tenant-a"
                            "&timeout=0.5")
    assert spec.master == "127.0.0.1:50051" and spec.metadata == "http://127.0.0.1:8080/metadata"
    assert spec.local_host == "127.0.0.1" and spec.namespace == "tenant-a" and spec.timeout_s == 0.5
    for bad in ("mooncake://h:1", "redis://h:1?metadata=x", "mooncake://h?metadata=x", "mooncake://h:1?metadata=x&y=1",
                "mooncake://h:1?metadata=x&timeout=0"):
        with pytest.raises(ValueError):
            RemoteSpec.parse(bad)


def test_keys_are_scoped_by_fingerprint_and_namespace() -> None:
    assert namespace("model-a") != namespace("model-b")
    assert namespace("model-a", "t1") != namespace("model-a", "t2") != namespace("model-a")


def test_breaker_opens_once_per_outage_and_backs_off() -> None:
    b = Breaker()
    assert b.closed
    b.failure("x")
    b.failure("y")  # the same outage: not opened twice
    assert not b.closed and b.opened == 1
    time.sleep(0.3)
    assert b.closed  # half-open: the next call tries
    b.failure("z")
    assert b.backoff == 1.0 and b.opened == 2
    b.success()
    assert b.backoff == 0.25
