"""Faults under a real vLLM engine: SIGKILL kvproc's copy worker, then its host tier, between turns of the chat
workload. vLLM must finish every request with the tokens it computes alone (kvproc degrades to misses and
recomputation, never to wrong KV or a hang), and nothing of kvproc's may be left in /dev/shm afterwards."""

from __future__ import annotations

import os
import random
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
    random_tokens,
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
    """The kill lands inside a turn, right after the worker side handed a step's moves to the mover, so moves (the
    host tier's reservations and commits) and the tier's own work are in flight: vLLM finishes every request of the
    run with its own tokens (nothing hangs: the module's timeout), and the outage is logged once."""
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
            engine(tiny_llama, kvproc_transfer_config()) as llm:
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


@pytest.mark.parametrize("guard", [True, False])
def test_pages_computed_over_a_failed_synchronous_load_are_never_saved(tiny_llama: Path, guard: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`loads="sync"` (the default for one KV cache group): the save planned in the step of a request's synchronous
    load holds pages that step's forward computed over the loaded ones. Here the load writes noise into vLLM's blocks
    and fails; vLLM recomputes the request, and that save must not run (`CopyJob.after`): the tier would otherwise
    keep pages computed over noise under the prompt's own keys, and a later hit would restore them. Control
    (`guard=False`: the mover ignores the failed load): the tier keeps them, and the replay restores them: its
    log-probabilities move away from vLLM alone's (its greedy tokens need not: a tiny random model's argmax can
    survive wrong KV, seen once in CI)."""
    import numpy as np

    from kvproc.integrations.vllm import moves as moves_mod
    from kvproc.integrations.vllm.connector import KvprocConnector

    rng = random.Random(21)
    first = random_tokens(rng, 70)  # leaves 2 pages (64 tokens) in the tier
    second = first[:64] + random_tokens(rng, 80)  # hits those 2, computes pages 2-3 in the load's step
    def logprobs(llm: Any, prompt: list[int]) -> tuple[list[int], list[float]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0].outputs[0]
        return list(out.token_ids), [lp[t].logprob for t, lp in zip(out.token_ids, out.logprobs)]

    with engine(tiny_llama) as llm:
        want = generate(llm, [second], 8)
        want_toks, want_lp = logprobs(llm, second)
    if not guard:
        monkeypatch.setattr(moves_mod.MoveQueue, "_after_failed_loads", staticmethod(lambda jobs: []))
    copy = KvprocConnector._copy
    noisy = [True]
    failed: list[str] = []  # the requests whose load wrote noise and failed

    def noisy_load(conn: Any, jobs: Any, to_vllm: bool) -> None:
        copy(conn, jobs, to_vllm)
        if not (to_vllm and noisy[0]):
            return
        noise = np.random.default_rng(3).standard_normal(1 << 16).astype(np.float32).view(np.uint8)
        for g in conn.contract.groups:
            for name in g.layer_names:
                flat = conn._kv[name].reshape(-1)
                arr = flat.numpy() if hasattr(flat, "numpy") else flat
                for j in jobs:
                    for b in j.vllm[g.index]:
                        arr[b * g.stride:b * g.stride + g.bytes_per_block] = noise[:g.bytes_per_block]
        failed.extend(j.req_id for j in jobs)
        raise RuntimeError("test: a load that wrote noise and failed")

    # Each step's saves run before the next step (they are not waited for otherwise): vLLM's recompute of the failed
    # request would else overwrite the noisy pages first, some of the time, and the control would see right bytes.
    wait_for_save = KvprocConnector.wait_for_save

    def saves_land_in_their_step(conn: Any) -> None:
        wait_for_save(conn)
        conn._moves.wait([j.job_id for j in conn._get_connector_metadata().saves], 60)

    monkeypatch.setattr(KvprocConnector, "_copy", noisy_load)
    monkeypatch.setattr(KvprocConnector, "wait_for_save", saves_land_in_their_step)
    with engine(tiny_llama, kvproc_transfer_config()) as llm:
        rt = live_runtime()
        generate(llm, [first], 4)
        assert rt.moves is not None and rt.moves.idle(60)
        rt.store.flush_saves(0, 60)
        assert reset_prefix_cache(llm)
        assert generate(llm, [second], 8) == want  # the failed load recomputed by vLLM
        assert failed, dict(rt.counters)  # the second prompt's load ran, wrote noise and failed
        assert rt.moves.idle(60)
        rt.store.flush_saves(0, 60)
        noisy[0] = False
        assert reset_prefix_cache(llm)
        c0 = dict(rt.counters)
        again, again_lp = logprobs(llm, second)
        hit = rt.counters.get("hit_tokens_loaded", 0) - c0.get("hit_tokens_loaded", 0)
    apart = max(abs(a - b) for a, b in zip(again_lp, want_lp))
    if guard:  # only the first prompt's pages were kept, and they are right
        assert hit == 64 and again == want_toks and apart <= 1e-4, (hit, again == want_toks, apart)
    else:  # the pages computed over noise came back
        assert hit == 128 and apart > 1e-3, (hit, apart)


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
