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

from tests.integrations.vllm.conftest import engine, kvproc_transfer_config, live_runtime, multi_turn

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
