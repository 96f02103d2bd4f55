"""The KV-event batch interval is an operator's setting (`ClusterStore.start(kv_events_interval_s=)`, `kvproc up
--kv-events-interval-ms`): it travels to the host tier's process (and the device publishers), is recorded in the
manifest beside the endpoints, and sets the batching a subscriber sees. No timing assert: a tier whose interval is an
hour sends nothing while a test runs (its process never flushes before its stop, and the workload stays far below
`max_pending`), one whose interval is 10 ms sends without anybody asking."""

from __future__ import annotations

import math
import subprocess
import sys
import time

import pytest

from kvproc.ipc import messages as m
from kvproc.runtime import manifest as mf
from kvproc.store.cluster import ClusterStore
from kvproc.tiers.kv_events import BlockStored, KvEventPublisher, decode_batch
from tests.conftest import cluster_store, compute, kvproc_up, replay_kv_events, wait_for

HOUR_MS = 3_600_000


def _workload(cs: ClusterStore, store, model, prompts: int = 6) -> None:  # type: ignore[no-untyped-def]
    for i in range(prompts):
        kv, cur, _, _ = compute(store, model, f"r{i}", [1000 * i + j for j in range(17)])
        store.retire(0, kv, cur)
        store.flush_saves(0, 10)


def _tier_counters(cs: ClusterStore) -> dict[str, int]:
    client = cs._tier_client(0)
    return dict(client.request(m.Stats(), timeout=5).counters)


def test_a_short_interval_sends_without_being_asked_and_is_in_the_manifest() -> None:
    with cluster_store(kv_events=True, device_kv_events=True, kv_events_interval_s=0.01) as (cs, store, model):
        found = mf.read_manifest(cs.cluster.runtime_dir)
        (tier,) = [p for p in found.processes if p.role == "host_tier"]
        assert tier.published["kv_events_interval_ms"] == "10"
        assert found.published["kv_events_device_interval_ms"] == "10"
        assert cs.device_events is not None and cs.device_events.publishers[0].batch_interval_s == 0.01
        _workload(cs, store, model)
        # nobody flushes the tier: what goes out went out because an interval ended
        wait_for(lambda: (c := _tier_counters(cs))["kv_events.events"] == c["kv_events.queued"], timeout=60,
                 what="every queued event sent by the interval alone")
        c = _tier_counters(cs)
        assert c["kv_events.queued"] < 4096  # far below max_pending: no batch was hurried by it
        kept = replay_kv_events(tier.published["kv_events_replay"])
        stored = [h for _, p in kept for e in decode_batch(p).events if isinstance(e, BlockStored)
                  for h in e.block_hashes]
        assert len(stored) >= 6 * 4  # every prompt's 4 full pages


def test_an_hour_interval_from_kvproc_up_holds_the_events_until_the_stop() -> None:
    with kvproc_up("kvint", "--kv-events", "--kv-events-interval-ms", str(HOUR_MS)) as (rd, _pid):
        (tier,) = [p for p in mf.read_manifest(rd).processes if p.role == "host_tier"]
        assert tier.published["kv_events_interval_ms"] == str(HOUR_MS) and tier.published["kv_events_tokens"] == "0"
        with cluster_store(1 << 20, tier_runtime_dir=rd) as (cs, store, model):
            _workload(cs, store, model)
            # 30 default intervals: a tier that batched over 50 ms would have sent by now (the workload itself
            # takes less than one, so without this wait the check below could not tell an hour from 50 ms). The
            # wait only ever weakens the check on a stalled machine; it cannot fail a tier whose hour runs.
            time.sleep(1.5)
            c = _tier_counters(cs)
            # queued (AllBlocksCleared at Configure, then every save's pages) and none sent: the hour has not ended,
            # nothing asked, max_pending is far away; the replay endpoint (a subscriber's view) holds no batch
            assert c["kv_events.queued"] >= 1 + 6 and c["kv_events.queued"] < 4096
            assert c["kv_events.events"] == 0 and c["kv_events.batches"] == 0 and c["kv_events.seq"] == 0
            assert replay_kv_events(tier.published["kv_events_replay"]) == []


@pytest.mark.parametrize("bad", [0.0, -0.05, math.nan, math.inf, 1e10])
def test_a_bad_interval_is_refused_before_anything_starts(bad: float, tmp_path) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match="batch interval must be > 0 and <= 3600 s"):
        ClusterStore.start(1 << 20, kv_events=True, kv_events_interval_s=bad, runtime_dir=str(tmp_path / "rd"))
    assert not (tmp_path / "rd").exists()  # refused before the launcher made anything
    with pytest.raises(ValueError, match="batch interval"):
        KvEventPublisher(str(tmp_path), 0, batch_interval_s=bad)
    assert list(tmp_path.iterdir()) == []  # no socket bound


@pytest.mark.parametrize("bad", ["0", "-5", "nan", "3600001", "fast"])
def test_kvproc_up_refuses_a_bad_interval_as_a_usage_error(bad: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    rd = tmp_path / "rd"
    r = subprocess.run([sys.executable, "-m", "kvproc", "up", "--cluster", "kvbad", "--runtime-dir", str(rd),
                        "--kv-events", "--kv-events-interval-ms", bad], capture_output=True, text=True, timeout=60,
                       check=False)
    assert r.returncode == 2 and "--kv-events-interval-ms" in r.stderr
    assert not rd.exists()
