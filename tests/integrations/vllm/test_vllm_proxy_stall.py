"""P/D through a stall of the shared tier (issue 39, item 3): `kvproc proxy` in front of two real `vllm serve`
processes (a kv_producer and a kv_consumer sharing one `kvproc up` tier) serves multi-turn conversations while that
tier's process is SIGSTOPped for longer than the stores' heartbeat liveness (1 s x 3: the engines call it dead), then
SIGCONTed. A user sees slower turns, never a failed or a wrong one: every turn is a 200 with vLLM alone's tokens, and
the consumer computes the prompts whose hand-off did not come (a short or missing hand-off, a failed load: vLLM's
`kv_load_failure_policy="recompute"`, which the connector sets).

The fault must have been hit, or the test proves nothing: the consumer's `/metrics` show prompt tokens it computed
beyond each request's anchor (with every hand-off loaded it computes the anchor only, `test_vllm_proxy.py`), and
the engines' logs show hand-off saves that failed (producer) and hand-offs found short (consumer). Once the stalls
are over the tier holds no open save, lease or hand-off (`kvproc up --metrics`).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import VLLMPD_CLUSTER
from tests.integrations.vllm.test_vllm_proxy import (
    _body,
    _consumer_counts,
    _free_port,
    _post,
    _proxy,
    _stop,
    serving,
)

pytestmark = pytest.mark.timeout(900)

CONVERSATIONS = TURNS = 4  # conftest's `multi_turn` reference workload
ROUNDS = 2  # the workload twice (the second round's prompts are partly in the tier and in vLLM's own caches)
STALL_S = 4.0  # past the stores' heartbeat liveness (1 s heartbeats, 3 missed: dead)
STALL_AFTER_TURNS = 2  # each round's stall starts once this many of its turns are done: others are in flight
# The tier's counters read (and printed); the first three must be 0 once the stalls are over.
OPEN = ("open_saves", "open_leases", "open_handoffs")
TIER_GAUGES = (*OPEN, "pending_pages", "saves_aborted_abandoned", "leases_released_abandoned",
               "reserves_refused_abandoned", "saves_reclaimed_by_ttl", "leases_reclaimed_by_ttl",
               "handoffs_reclaimed_by_ttl", "save_dedup_pages")


class _Turns:
    """Every turn's outcome, shared by the conversation threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.done = 0
        self.failed: list[str] = []
        self.wrong: list[str] = []
        self.ok = 0

    def record(self, what: str, status: int, got: list[int] | None, want: list[int], err: Any) -> None:
        with self.lock:
            self.done += 1
            if status != 200 or got is None:
                self.failed.append(f"{what}: {status} {err}")
            elif got != want:
                self.wrong.append(f"{what}: got {got} want {want}")
            else:
                self.ok += 1


def _turn(url: str, prompt: list[int], stream: bool) -> tuple[int, list[int] | None, Any]:
    """One turn through the proxy: (status, the completion's token ids or None, the error)."""
    if not stream:
        status, out = _post(url, _body(prompt, return_token_ids=True), timeout=300)
        if status != 200:
            return status, None, out
        return status, list(out["choices"][0]["token_ids"]), None
    status, events = _post(url, _body(prompt, stream=True, return_token_ids=True), timeout=300)
    if status != 200:
        return status, None, events
    errors = [ev["error"] for ev in events if "error" in ev]
    if errors:  # a failure after the stream started: sent in the stream
        return 502, None, errors
    return status, [t for ev in events for ch in ev.get("choices", []) for t in ch.get("token_ids") or []], None


def _conversation(url: str, c: int, rnd: int, reference: list[tuple[list[int], list[int]]], turns: _Turns) -> None:
    """Conversation `c`'s turns, each prompt built from the previous turn's answer *as served* (a wrong answer would
    carry into the next prompt, as for a real client) plus the reference's next user message. Streamed or not by
    conversation."""
    stream = c % 2 == 1
    prompt = list(reference[c][0])
    for t in range(TURNS):
        want_prompt, want = reference[t * CONVERSATIONS + c]
        status, got, err = _turn(url, prompt, stream)
        turns.record(f"round {rnd} conversation {c} turn {t} ({'streamed' if stream else 'whole'})", status, got,
                     want, err)
        if got is None or t + 1 == TURNS:
            return
        nxt = reference[(t + 1) * CONVERSATIONS + c][0]
        prompt = prompt + got + nxt[len(want_prompt) + len(want):]


def _stall_once(pid: int, turns: _Turns, after: int, stalls: list[float]) -> None:
    """SIGSTOP exactly the shared tier's process once `after` turns are done, SIGCONT it `STALL_S` later."""
    while turns.done < after:
        time.sleep(0.05)
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        time.sleep(STALL_S)
    finally:
        os.kill(pid, signal.SIGCONT)
    stalls.append(time.monotonic() - t0)


def _tier_counters(metrics_url: str, deadline_s: float = 60) -> dict[str, float]:
    """The shared tier's own counters (`kvproc up --metrics`: `kvproc:counter{role="host_tier", name=...}`); none
    while its launcher has not seen it answer since a stall: asked again until they come."""
    end = time.monotonic() + deadline_s
    while not (out := _scrape_tier(metrics_url)) and time.monotonic() < end:
        time.sleep(0.5)
    return out


def _tier_settled(metrics_url: str, deadline_s: float = 60) -> dict[str, float]:
    """The tier's counters once it holds no open save, lease or hand-off (what the stalls left is settled by the
    stores' reconnect or by its TTLs), or at the deadline."""
    end = time.monotonic() + deadline_s
    while True:
        out = _tier_counters(metrics_url)
        if not any(out.get(k) for k in OPEN) or time.monotonic() > end:
            return out
        time.sleep(0.5)


def _scrape_tier(metrics_url: str) -> dict[str, float]:
    text = urllib.request.urlopen(metrics_url + "/metrics", timeout=30).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'kvproc:counter\{(.*)\} (\S+)$', line)
        if m and 'role="host_tier"' in m[1]:
            name = re.search(r'name="([^"]+)"', m[1])
            if name and name[1].removeprefix("index.") in TIER_GAUGES:
                out[name[1].removeprefix("index.")] = float(m[2])
    return out


def test_proxy_turns_survive_tier_stalls(reference: list[tuple[list[int], list[int]]], tiny_llama: Path,
                                         tmp_path: Path) -> None:
    from tests.conftest import kvproc_up

    turns = _Turns()
    stalls: list[float] = []
    tier_metrics = f"127.0.0.1:{_free_port()}"
    with kvproc_up(f"{VLLMPD_CLUSTER}stall", "--host-mib", "128", "--metrics", tier_metrics) as (tier, tier_pid), \
            serving(tiny_llama, tier, tmp_path) as servers:
        servers.wait_ready()
        proxy, url = _proxy(servers.producer, servers.consumer)
        try:
            hits0, computed0, done0 = _consumer_counts(servers.consumer)
            for rnd in range(ROUNDS):
                before = turns.done
                staller = threading.Thread(target=_stall_once, args=(tier_pid, turns, before + STALL_AFTER_TURNS,
                                                                     stalls))
                staller.start()
                threads = [threading.Thread(target=_conversation, args=(url, c, rnd, reference, turns))
                           for c in range(CONVERSATIONS)]
                for th in threads:
                    th.start()
                for th in threads:
                    th.join()
                staller.join()
                print(f"round {rnd}: tier {_tier_counters('http://' + tier_metrics)}")
            tier_after = _tier_settled("http://" + tier_metrics)
            # The turns first: a dead engine (a turn that failed) answers no /metrics.
            assert not turns.failed, turns.failed
            assert not turns.wrong, turns.wrong
            assert turns.done == ROUNDS * CONVERSATIONS * TURNS
            hits, computed, done = _consumer_counts(servers.consumer)
        finally:
            _stop(proxy, 10)
    logs = {side: path.read_text(errors="replace") for side, path in servers.logs.items()}
    events = Counter({f"{side}:{name}": text.count(name) for side, text in logs.items()
                      for name in ("handoff save failed", "kvproc_handoff_short_hit", "kvproc_handoff_refused")})
    print(f"turns {turns.done} (ok {turns.ok}, failed {len(turns.failed)}, wrong {len(turns.wrong)}); "
          f"stalls {[round(s, 1) for s in stalls]} s; consumer: {done - done0:.0f} requests, "
          f"{hits - hits0:.0f} prompt tokens loaded from kvproc, {computed - computed0:.0f} computed; "
          f"log events {dict(+events)}; tier after {tier_after}")
    assert len(stalls) == ROUNDS
    # The fault was hit: the consumer computed prompt tokens beyond the anchors (hand-offs that did not come through
    # the stalled tier), and it still loaded others (the tier served again after each stall).
    assert done - done0 == turns.done
    assert computed - computed0 > done - done0, "no hand-off was missed: the stalls hit no turn"
    assert hits - hits0 > 0
    # ... because of the stalls: the producer's hand-off saves failed (the tier called dead) and the consumer found
    # those hand-offs short (its logs, the engines' only record of kvproc's counters in `vllm serve`).
    assert events["producer:handoff save failed"] > 0 and events["consumer:kvproc_handoff_short_hit"] > 0, events
    # Nothing the stalls interrupted stays open in the tier (saves, leases, hand-offs).
    assert not any(tier_after.get(k) for k in OPEN), tier_after
