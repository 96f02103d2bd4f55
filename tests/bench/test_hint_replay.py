"""`kvproc bench replay --capacity ... --hint`: the oracle's bits, a hand-computed hinted replay through the host
tier's index, no hint = today's replay, and the command's table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvproc.bench.hint_replay import oracle_bits, parse_hint, replay_host_index
from kvproc.bench.replay import TraceRequest, main
from kvproc.bench.synthetic_trace import synthetic_trace

# A (turn 1), B, C, then A's second turn 3 s later; 3 page slots of room.
TRACE = [TraceRequest(0, 1024, 1, (10, 11)), TraceRequest(1000, 1024, 1, (20, 21)),
         TraceRequest(2000, 512, 1, (30,)), TraceRequest(3000, 1500, 1, (10, 11, 12))]


def test_the_oracle_bit_is_whether_the_conversation_comes_back_in_time() -> None:
    assert oracle_bits(TRACE, 300) == [True, False, False, False]  # A's last full block (11) is back after 3 s
    assert oracle_bits(TRACE, 2) == [False, False, False, False]  # not within 2 s
    assert oracle_bits(TRACE, 300, noise=1.0) == [False, True, True, True]  # every bit flipped


@pytest.mark.parametrize("policy", ["lru", "lrfu"])
def test_a_hinted_replay_hand_computed(policy: str) -> None:
    # No hint: B's save evicts A's tail (11), C's A's head (10): A's second turn misses.
    # A hinted (300 s): B's save can only evict A's pages (11 goes, 10 stays hinted), C's evicts B's tail (21):
    # A's second turn hits its first block, 512 of the 4,060 input tokens.
    plain = replay_host_index(TRACE, 3 * 512, policy)
    hinted = replay_host_index(TRACE, 3 * 512, policy, oracle_bits(TRACE, 300), 300.0)
    assert plain.prefill_tokens_saved == 0 and plain.evictions == 1 + 1 + 3  # A2 saves 3 new pages: the whole cache
    assert hinted.prefill_tokens_saved == 512 and hinted.token_hit_ratio == pytest.approx(512 / 4060)


@pytest.mark.parametrize("policy", ["lru", "lrfu"])
def test_no_hint_is_the_same_replay(policy: str) -> None:
    trace = synthetic_trace(requests=400)
    plain = replay_host_index(trace, 2e5, policy)
    assert replay_host_index(trace, 2e5, policy, [False] * len(trace), 300.0) == plain
    assert replay_host_index(trace, 2e5, policy, [True] * len(trace), 0.0) == plain
    assert replay_host_index(trace, 2e5, policy, oracle_bits(trace, 300), 300.0) != plain  # control: a hint moves it


def test_hint_argument_parsing() -> None:
    assert parse_hint("within=300").retain == 300 and parse_hint("within=300;retain=1200,noise=0.1").noise == 0.1
    for bad in ("retain=5", "within=0", "within=5,noise=2", "within=5,other=1", "within"):
        with pytest.raises(ValueError):
            parse_hint(bad)


def test_cli_table_with_and_without_the_hint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": r.timestamp, "input_length": r.input_length,
                                         "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n"
                             for r in TRACE))
    out = tmp_path / "rows.json"
    assert main(["--trace", str(trace), "--capacity", "1536", "--policy", "lru,belady", "--traces", "conversation",
                 "--hint", "within=300", "--json", str(out)]) == 0
    rows = {r["policy"]: r for r in json.loads(out.read_text())["policies"]}
    assert set(rows) == {"lru", "lru+hint", "belady"}
    assert rows["lru"]["prefill_tokens_saved"] == 0 and rows["lru+hint"]["prefill_tokens_saved"] == 512
    assert "lru+hint" in capsys.readouterr().out
    assert main(["--trace", str(trace), "--capacity", "1536", "--hint", "retain=3"]) == 2
