"""Faults under a real vLLM engine: SIGKILL kvproc's copy worker, then its host tier, between turns of the chat
workload. vLLM must finish every request with the tokens it computes alone (kvproc degrades to misses and
recomputation, never to wrong KV or a hang), and nothing of kvproc's may be left in /dev/shm afterwards."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import structlog

from tests.integrations.vllm.conftest import (
    engine,
    generate,
    kvproc_transfer_config,
    live_runtime,
    multi_turn,
    reset_prefix_cache,
)

pytestmark = pytest.mark.timeout(600)


def _segments(cluster_name: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"kvproc.{cluster_name}."))


@pytest.mark.parametrize("victim", ["copy_worker", "host_tier"])
def test_sigkill_of_a_kvproc_process_mid_run_keeps_vllm_correct(tiny_llama: Path, victim: str,
                                                                 reference: list[tuple[list[int], list[int]]]) -> None:
    killed: list[int] = []

    def before_turn(t: int) -> None:
        if t == 2:  # two turns of saves and hits behind it, two turns to serve without (or with a restarted) it
            pid = live_runtime().cluster.cluster.pid(victim)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    with engine(tiny_llama, kvproc_transfer_config()) as llm:
        name = live_runtime().cluster.cluster.name
        got = multi_turn(llm, before_turn=before_turn)
        rt = live_runtime()
        assert killed
        assert rt.counters.get("pages_saved_from_vllm", 0) > 0
    assert [o for _, o in got] == [o for _, o in reference]
    assert _segments(name) == []


@pytest.mark.parametrize("victim", ["copy_worker", "host_tier"])
def test_sigkill_mid_generate_with_moves_in_flight(tiny_llama: Path, victim: str, monkeypatch: pytest.MonkeyPatch,
                                                   reference: list[tuple[list[int], list[int]]]) -> None:
    """The kill lands inside a turn, right after the worker side handed a step's moves to the mover (the copy
    worker moves them: `mover="cma"`), so moves and the tier's own copies are in flight: vLLM finishes every request
    of the run with its own tokens (nothing hangs: the module's timeout), and the outage is logged once."""
    from kvproc.integrations.vllm.connector import KvprocConnector

    turn = [-1]
    killed: list[int] = []
    orig = KvprocConnector.wait_for_save

    def wait_for_save(self: Any) -> None:
        orig(self)
        moves = self.rt.moves
        if turn[0] == 2 and not killed and moves is not None and moves.in_flight():
            pid = self.rt.cluster.cluster.pid(victim)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    monkeypatch.setattr(KvprocConnector, "wait_for_save", wait_for_save)
    with structlog.testing.capture_logs() as logs, \
            engine(tiny_llama, kvproc_transfer_config(mover="cma")) as llm:
        name = live_runtime().cluster.cluster.name
        got = multi_turn(llm, before_turn=lambda t: turn.__setitem__(0, t))
        counters = dict(live_runtime().counters)
        moves = live_runtime().moves
        failed_batches = moves.failures if moves is not None else 0
    assert killed, "no step of turn 2 had moves in flight"
    assert [o for _, o in got] == [o for _, o in reference]
    assert counters.get("pages_saved_from_vllm", 0) > 0
    assert _segments(name) == []
    died = [e for e in logs if e["event"] == "child_died" and victim in str(e.get("child", ""))]
    assert len(died) == 1, died
    # The connector's own word on the outage: once if any of its moves failed (however many batches did), never
    # per batch.
    assert sum(e["event"] == "kvproc_moves_failing" for e in logs) == (1 if failed_batches else 0), failed_batches


@pytest.mark.parametrize("policy", ["recompute", "vllm"])
def test_a_failed_load_is_recomputed_not_a_failed_request(tiny_llama: Path, policy: str,
                                                          reference: list[tuple[list[int], list[int]]],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 39 item 3 on vLLM: every load of the replay fails its after-copy check (a mock of the tier's side: the
    slots read as handed to a save). With the connector's default `load_failure_policy="recompute"` vLLM computes
    those tokens and every request ends with its own tokens. The control keeps vLLM's default policy ("fail"): the
    same failed loads end requests with an error."""
    from kvproc.store.tier_slots import TierSlots

    with engine(tiny_llama, kvproc_transfer_config(load_failure_policy=policy)) as llm:
        multi_turn(llm)  # every page saved
        rt = live_runtime()
        assert rt.moves is not None and rt.moves.idle(60)
        rt.store.flush_saves(0, 60)
        c0 = dict(rt.counters)
        monkeypatch.setattr(TierSlots, "intact", lambda self, *a: False)
        assert reset_prefix_cache(llm)
        prompts = [p for p, _ in reference[-4:]]
        try:
            outs: list[list[int]] | None = generate(llm, prompts)
        except Exception:  # noqa: BLE001 - vLLM's "fail" policy may surface as an exception
            if policy == "recompute":
                raise
            outs = None
        counters = {k: v - c0.get(k, 0) for k, v in rt.counters.items()}
    assert counters.get("loads_lease_lost", 0) > 0, sorted(counters.items())
    if policy == "recompute":
        assert outs == [o for _, o in reference[-4:]]
    else:
        assert outs != [o for _, o in reference[-4:]]


@pytest.mark.parametrize("remap", [True, False])
def test_a_replaced_shared_tier_serves_hits_again_without_a_restart(tiny_llama: Path, remap: bool,
                                                                   reference: list[tuple[list[int], list[int]]],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 39 item 4 on vLLM's direct path: `kvproc up` SIGKILLed and started again on the same runtime dir under a
    running engine. The store re-attaches; the connector's mover maps the new tier's segment before its next copy,
    and hits come back with vLLM alone's tokens. The control keeps the old mapping (`remap_if_replaced` a no-op):
    every save then fails its fence in the old segment, and the replay finds nothing to load."""
    from kvproc.store.host_direct import HostDirect
    from tests.integrations.vllm.conftest import ReplaceableTier, metrics

    if not remap:
        monkeypatch.setattr(HostDirect, "remap_if_replaced", lambda self: None)
    tier = ReplaceableTier(f"vllmrep{os.getpid()}{int(remap)}")
    try:
        with engine(tiny_llama, kvproc_transfer_config(tier_runtime_dir=tier.runtime_dir)) as llm:
            rt = live_runtime()
            multi_turn(llm, turns=1)
            tier.replace_under(rt)
            assert multi_turn(llm) == reference
            assert rt.moves is not None and rt.moves.idle(60)
            assert reset_prefix_cache(llm)
            m0, c0 = metrics(llm), dict(rt.counters)
            outs = generate(llm, [p for p, _ in reference[-4:]])
            hits = metrics(llm)["vllm:external_prefix_cache_hits"] - m0["vllm:external_prefix_cache_hits"]
            remapped = rt.counters.get("tier_remapped", 0)
    finally:
        tier.close()
    assert outs == [o for _, o in reference[-4:]]
    if remap:
        assert remapped == 1 and hits > 0, (remapped, hits, c0)
    else:
        assert hits == 0
