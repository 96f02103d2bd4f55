"""`kvproc bench ipc` runs end to end on a few operations (no timing assertions: benchmarks are not tests)."""

import json
import os

import pytest

from kvproc.bench.ipcbench import main
from kvproc.ipc.segment import list_segments


@pytest.mark.timeout(120)
def test_ipc_bench_runs_and_writes_the_documented_json(tmp_path):
    ours = f"kvproc.cs{os.getpid()}x"  # the bench's ClusterStores are named after this process: only those count
    before = {s for s in list_segments() if s.startswith(ours)}
    out, png = tmp_path / "ipc.json", tmp_path / "ipc.png"
    assert main(["--quick", "--json", str(out), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 1000  # --plot
    doc = json.loads(out.read_text())
    assert [r["blocks"] for r in doc["results"]] == [1, 16, 64, 256]
    for r in doc["results"]:
        for arm in ("resolve", "burst"):
            assert {f"resolve_{arm}_us", f"{arm}_overhead_total_rtts", f"{arm}_overhead_beyond_needed",
                    f"{arm}_overhead_beyond_needed_replayed_copy"} <= set(r)
            assert r[f"resolve_{arm}_us"] > 0
            # every resolve's one Load came back with the worker's own copy time, which the overhead subtracts
            assert r[f"{arm}_one_load_share"] == 1.0 and r[f"{arm}_copy_in_situ_us"] > 0
        assert r["raw_rtt_us"] > 0
    assert doc["resolves_per_s"] > 0
    assert not {s for s in list_segments() if s.startswith(ours)} - before  # the bench's cluster and arenas are gone


@pytest.mark.timeout(600)
def test_the_observability_ab_runs_both_arms_in_their_own_processes_and_writes_the_ratios(tmp_path):
    out = tmp_path / "ab.json"
    assert main(["--observe-ab", "2", "--n", "20", "--scrape-s", "0.2", "--device-events", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [p["first"] for p in doc["pairs"]] == ["plain", "observed"]  # the order alternates
    for p in doc["pairs"]:
        assert p["plain_resolve_median_us"] > 0 and p["observed_resolve_median_us"] > 0
        assert "plain_metrics_scrapes" not in p  # the plain arm has no endpoint and no observer
        assert p["observed_kv_event_batches_read"] > 0  # the observed arm's seals were published and read
        # --device-events: the observed arm's device pool published too; the plain arm has no publisher
        assert p["observed_device_event_batches"] > 0 and p["plain_device_event_batches"] == 0
    assert set(doc["median_ratio"]) == {"resolve_median_us", "resolve_mean_us", "seal_median_us"}
    assert doc["histogram_observe_ns"] > 0 and doc["device_events"] is True


@pytest.mark.timeout(600)
def test_the_observability_toggle_times_both_arms_in_one_run_and_scrapes_only_when_on(tmp_path):
    out = tmp_path / "toggle.json"
    # --scrape-s 0: a scrape on every on round (the rate is the bench's own clock, so a tiny one scrapes each time)
    assert main(["--observe-toggle", "8", "--n", "5", "--scrape-s", "0", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert len(doc["per_round_median"]["on"]) == len(doc["per_round_median"]["off"]) == 4  # ABBA: 4 of each
    assert len(doc["pair_ratios"]) == 4 and all(r > 0 for r in doc["pair_ratios"])
    assert doc["scrapes"] == 4  # one per on round, none in an off round
    assert doc["observer"]["metrics_scrapes"] == 5  # those, and the one before "ready"
    assert doc["observer"]["kv_event_batches_read"] > 0 and doc["device_batches"] > 0
    lo, hi = doc["median_ratio"][1:]
    assert lo <= doc["median_ratio"][0] <= hi


@pytest.mark.timeout(600)
def test_the_toggle_alternating_every_resolve_pairs_each_rounds_arms_and_charges_the_publishers_cpu_to_on(tmp_path):
    out = tmp_path / "toggle.json"
    assert main(["--observe-toggle", "6", "--n", "8", "--toggled", "events", "--alternate", "resolve",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    # every round is one pair: half its resolves on, half off (ABBA over the resolves)
    assert len(doc["per_round_median"]["on"]) == len(doc["per_round_median"]["off"]) == len(doc["pair_ratios"]) == 6
    assert doc["scrapes"] == 0 and doc["alternate"] == "resolve"
    # the on resolves' events, and only theirs (the seals are made with the listener off): each registers its 16
    # restored pages (one BlockStored), and its churn may remove some
    assert doc["device_events"] >= len(doc["pair_ratios"]) * 8 // 2 and doc["publisher_busy_s"] > 0
    assert doc["publisher_thread_cpu_s"] >= doc["publisher_busy_s"]  # the whole thread: its batches and more
    with pytest.raises(ValueError, match="events only"):
        main(["--observe-toggle", "4", "--n", "4", "--alternate", "resolve"])  # scrapes cannot be given to a resolve


def test_the_bench_prompts_stay_valid_token_ids_and_distinct_however_many_a_run_makes():
    # A 1,600-round --observe-toggle run makes 640,000 prompts: `4099 * n` alone passed 2**31 - 1 at n = 523,906 and
    # the run died in the hasher. The bases wrap modulo a prime instead, so they stay distinct and in range.
    from kvproc.bench.ipcbench import IpcBench

    bench = IpcBench.__new__(IpcBench)  # prompt() reads only the counter: no cluster needed
    firsts = set()
    for start in (0, 523_900, 640_000, 100_000_000):  # distinct for fewer than PROMPT_BASES prompts
        bench._next = start
        for _ in range(10):
            p = bench.prompt(64)
            assert 0 <= min(p) and max(p) <= 2**31 - 2  # what the hasher accepts (`core.hashing.tokens_to_bytes`)
            firsts.add(p[0])
    assert len(firsts) == 40  # a distinct first token per prompt: a distinct chain of page hashes
