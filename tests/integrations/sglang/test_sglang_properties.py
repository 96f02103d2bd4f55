"""Properties of the backend over arbitrary sequences of SGLang's calls, against a model of what was stored: gets are
bit-exact for the leading run of stored keys and touch nothing after it, `batch_exists` is that run's length, and
every lease and save the calls opened in the tier settles (the tier's own counters, asked of its process)."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproc.store.host_direct import HostDirect
from tests.hypothesis_budget import examples
from tests.integrations.sglang.conftest import PAGE, backend, host_pool, page_bytes, tier_stats
from tests.integrations.sglang.test_sglang_backend import keys, pages

pytestmark = pytest.mark.timeout(300)

UNIVERSE = keys(10)
SRC, DST = 0, 8  # the pool's pages a set reads from and a get writes into (4 each at most)
run_keys = st.lists(st.sampled_from(UNIVERSE), min_size=0, max_size=4, unique=True)
ops = st.lists(st.one_of(st.tuples(st.just("set"), run_keys, st.integers(0, 2**31)),
                         st.tuples(st.just("get"), run_keys, st.just(0)),
                         st.tuples(st.just("exists"), run_keys, st.just(0))), max_size=8)


def _leading(stored: dict[str, bytes], ks: list[str]) -> int:
    n = 0
    while n < len(ks) and ks[n] in stored:
        n += 1
    return n


def _settled(b: Any, deadline_s: float = 60.0) -> dict[str, int]:
    """The tier's counters once its open leases and saves are 0 (releases are one-way messages: they land a moment
    after the call returned). A generous deadline on a loaded machine, never a timing assertion."""
    end = time.monotonic() + deadline_s
    while True:
        s = tier_stats(b)
        if (s["open_leases"] == 0 and s["open_saves"] == 0) or time.monotonic() > end:
            return s
        time.sleep(0.05)


def test_calls_match_a_model_and_every_lease_settles() -> None:
    pool = host_pool()
    with backend(pool) as b:
        stored: dict[str, bytes] = {}

        @settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
        @given(ops)
        def run(calls: list[tuple[str, list[str], int]]) -> None:
            for op, ks, seed in calls:
                n = len(ks)
                if op == "set":
                    for p in range(n):  # fresh bytes for the pages this set reads
                        g = torch.Generator().manual_seed(seed + p)
                        page = pool.get_data_page((SRC + p) * PAGE, flat=False)
                        page.view(torch.uint8).copy_(torch.randint(0, 256, page.view(torch.uint8).shape,
                                                                   dtype=torch.uint8, generator=g))
                    assert b.batch_set_v1(ks, pages(SRC, n)) == [True] * n
                    for p, k in enumerate(ks):
                        stored.setdefault(k, page_bytes(pool, (SRC + p) * PAGE))  # a stored page is kept as is
                elif op == "get":
                    before = [page_bytes(pool, (DST + p) * PAGE) for p in range(n)]
                    run_len = _leading(stored, ks)
                    assert b.batch_get_v1(ks, pages(DST, n)) == [p < run_len for p in range(n)]
                    after = [page_bytes(pool, (DST + p) * PAGE) for p in range(n)]
                    assert after[:run_len] == [stored[k] for k in ks[:run_len]]
                    assert after[run_len:] == before[run_len:]
                else:
                    assert b.batch_exists(ks) == _leading(stored, ks)

        run()
        s = _settled(b)
        assert s["open_leases"] == 0 and s["open_saves"] == 0, s
        assert s["entries"] == len(stored)
        assert s.get("leases_reclaimed_by_ttl", 0) == 0  # every lease was released, none waited for the TTL


def test_mocked_lease_check_failing_loads_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's side of HostDirect's contract, the lease check mocked: when `intact` says the copied slots may
    be another page's (a lease too old, a slot handed to a save), the backend reports the pages failed (SGLang
    recomputes them) and still releases the lease."""
    pool = host_pool()
    with backend(pool) as b:
        assert b.batch_set_v1(keys(2), pages(0, 2)) == [True] * 2
        with monkeypatch.context() as m:
            m.setattr(HostDirect, "intact", lambda self, slots, gens, leased_at, now: False)
            assert b.batch_get_v1(keys(2), pages(4, 2)) == [False, False]
        assert b.kvproc_counters()["get_lease_lost"] == 1
        assert b.batch_get_v1(keys(2), pages(4, 2)) == [True, True]
        assert _settled(b)["open_leases"] == 0
