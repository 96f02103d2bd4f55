"""Faults under a real vLLM engine: SIGKILL kvproc's copy worker, then its host tier, between turns of the chat
workload. vLLM must finish every request with the tokens it computes alone (kvproc degrades to misses and
recomputation, never to wrong KV or a hang), and nothing of kvproc's may be left in /dev/shm afterwards."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest

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
