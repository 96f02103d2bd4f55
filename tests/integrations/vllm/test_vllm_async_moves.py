"""The connector's moves run off vLLM's forward thread (`kvproc/integrations/vllm/moves.py`): saves are never waited
for (a finished request's free is delayed until its save settles); loads land before the forward that first reads them
(`loads="sync"`, the default for a model of one KV cache group: the request runs in the step that schedules it) or are
reported through `get_finished` (`loads="async"`: vLLM holds the request back a step meanwhile; the default for several
groups). Each test slows or breaks the mover (the connector's `_copy`, which the mover thread runs) to make the
asynchrony observable; the engine and kvproc's processes are real."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import pytest

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


def assert_idle(idle: bool) -> None:
    assert idle, "the connector's moves did not settle within 60 s"


class _Overlap:
    """Counts vLLM's steps (scheduler side) and the moves during which at least one step began, loads and saves
    apart."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, delay_s: float) -> None:
        from kvproc.integrations.vllm.connector import KvprocConnector

        self.steps = 0
        self.moves = 0
        self.overlapped = 0
        self.loads = 0
        self.loads_overlapped = 0
        build, copy = KvprocConnector.build_connector_meta, KvprocConnector._copy

        def build_connector_meta(conn: Any, scheduler_output: Any) -> Any:
            self.steps += 1
            return build(conn, scheduler_output)

        def slow_copy(conn: Any, jobs: Any, to_vllm: bool) -> None:
            before = self.steps
            time.sleep(delay_s)  # a slow mover: the step loop either waits for it or goes on
            copy(conn, jobs, to_vllm)
            self.moves += 1
            self.overlapped += self.steps > before
            if to_vllm:
                self.loads += 1
                self.loads_overlapped += self.steps > before

        monkeypatch.setattr(KvprocConnector, "build_connector_meta", build_connector_meta)
        monkeypatch.setattr(KvprocConnector, "_copy", slow_copy)


def test_slow_moves_overlap_vllm_steps_and_keep_tokens(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                                       reference: list[tuple[list[int], list[int]]]) -> None:
    ov = _Overlap(monkeypatch, delay_s=0.15)
    with engine(tiny_llama, kvproc_transfer_config(loads="async")) as llm:
        # Each turn starts once the last one's saves landed: with the slow mover a loaded machine could otherwise
        # schedule a turn before kvproc holds the previous one's pages (a miss, no load to observe). The loads of a
        # turn still run while vLLM steps the turn's other requests.
        got = multi_turn(llm, before_turn=lambda t: assert_idle(live_runtime().moves.idle(60)))
        # 113-token prompts, 16 tokens out: the last step computes token 128, so each request's 4th page is saved
        # in its last step and finishes with that save in flight (the slow mover): vLLM must keep its blocks.
        rng = random.Random(5)
        generate(llm, [random_tokens(rng, 113) for _ in range(2)], max_tokens=16)
        sched = llm.llm_engine.engine_core.engine_core.scheduler
        held = [rid for rid, req in sched.requests.items() if req.is_finished()]
        counters = dict(live_runtime().counters)
        assert live_runtime().moves.idle(60)  # the slow mover finished the saves ...
        generate(llm, [random_tokens(rng, 8)], max_tokens=2)  # ... and this run's steps report them: blocks freed
        left = [rid for rid in held if rid in sched.requests]
    assert [o for _, o in got] == [o for _, o in reference]
    assert counters.get("loads_async", 0) > 0  # vLLM held requests back for loads and get_finished released them
    assert counters.get("frees_delayed", 0) > 0 and held, (counters.get("frees_delayed"), held)
    assert left == []  # every delayed free was reported (finished_sending), none leaked
    assert ov.moves > 0 and ov.overlapped > 0, (ov.moves, ov.overlapped)  # vLLM stepped on while bytes moved
    assert ov.loads > 0 and ov.loads_overlapped > 0, (ov.loads, ov.loads_overlapped)  # loads too


def test_synchronous_loads_never_overlap_a_step_and_saves_still_do(
        tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, reference: list[tuple[list[int], list[int]]]) -> None:
    """The default for a model of one KV cache group (`loads="auto"` is "sync" there): a load lands before the
    forward that reads it, so no step begins while one runs; saves are still not waited for (steps begin while
    they run); the tokens are the same. It is also the control of the asynchronous overlap count above."""
    ov = _Overlap(monkeypatch, delay_s=0.05)
    with engine(tiny_llama, kvproc_transfer_config()) as llm:
        got = multi_turn(llm)
        counters = dict(live_runtime().counters)
    assert [o for _, o in got] == [o for _, o in reference]
    assert counters.get("loads_async", 0) == 0 and counters.get("hit_tokens_loaded", 0) > 0
    assert ov.loads > 0 and ov.loads_overlapped == 0, (ov.loads, ov.loads_overlapped)
    assert ov.moves > ov.loads and ov.overlapped > 0, (ov.moves, ov.loads, ov.overlapped)


@pytest.mark.parametrize("loads, steps", [("sync", 1), ("async", 2)])
def test_a_restored_request_runs_in_the_step_that_schedules_it(tiny_llama: Path, loads: str, steps: int) -> None:
    """What synchronous loads buy: a prompt restored from kvproc (after vLLM forgot it) gets its first token from the
    first engine step that sees it, as a prompt vLLM computes itself would; asynchronous loads hold it back a step
    (the `("async", 2)` case is this test's control: the step count is what the mode changes)."""
    prompt = random_tokens(random.Random(12), 100)
    with engine(tiny_llama, kvproc_transfer_config(loads=loads)) as llm:
        first = generate(llm, [prompt], max_tokens=4)
        assert live_runtime().moves.idle(60)
        generate(llm, [[5, 6]], max_tokens=1)  # a step that hears the saves settled: the delayed frees go
        assert reset_prefix_cache(llm)
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        core = llm.llm_engine
        core.add_request("again", TokensPrompt(prompt_token_ids=prompt), SamplingParams(max_tokens=4, temperature=0))
        taken = 0
        while True:
            outs = core.step()
            taken += 1
            if any(o.request_id == "again" and o.outputs[0].token_ids for o in outs):
                break
            assert taken < 50, "no first token in 50 steps"
        while core.has_unfinished_requests():
            core.step()
        counters = dict(live_runtime().counters)
    assert counters.get("hit_tokens_loaded", 0) >= 96, counters  # the prompt's pages came from kvproc
    assert first  # (the first run's tokens are compared with kvproc's elsewhere)
    assert taken == steps, (loads, taken)


@pytest.mark.parametrize("loads", ["sync", "async"])
def test_control_a_mover_that_drops_loads_changes_tokens(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch,
                                                         reference: list[tuple[list[int], list[int]]],
                                                         loads: str) -> None:
    """The loads really feed vLLM's forward, either way: reported done without copying, the tokens change."""
    from kvproc.integrations.vllm.connector import KvprocConnector

    copy = KvprocConnector._copy

    def drop_loads(conn: Any, jobs: Any, to_vllm: bool) -> None:
        if not to_vllm:
            copy(conn, jobs, to_vllm)

    monkeypatch.setattr(KvprocConnector, "_copy", drop_loads)
    with engine(tiny_llama, kvproc_transfer_config(loads=loads)) as llm:
        got = multi_turn(llm)
        counters = dict(live_runtime().counters)
    assert (counters.get("loads_async", 0) > 0) == (loads == "async") and counters.get("hit_tokens_loaded", 0) > 0
    assert [o for _, o in got] != [o for _, o in reference]


def test_idle_steps_wait_for_the_load_instead_of_spinning(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the only request waits for its load, vLLM schedules nothing and its engine loop calls the connector again
    at once; `get_finished` then waits for the move (GIL released) instead of returning, so a 1 s load costs a few
    idle steps, not hundreds (they held the GIL and a core the moves need: bench/RESULTS.md, "vLLM connector").
    Control (run by hand): `IDLE_WAIT_S = 0` gives dozens of idle steps during the same load and fails the bound."""
    from kvproc.integrations.vllm import connector as conn_mod
    from kvproc.integrations.vllm.connector import KvprocConnector

    monkeypatch.setattr(conn_mod, "IDLE_WAIT_S", 30.0)  # the bound is the load itself, whatever the machine's speed
    build, copy = KvprocConnector.build_connector_meta, KvprocConnector._copy
    idle = {"steps": 0, "during_load": 0}
    loading = [False]

    def build_connector_meta(conn: Any, scheduler_output: Any) -> Any:
        if scheduler_output.total_num_scheduled_tokens == 0:
            idle["steps"] += 1
            idle["during_load"] += loading[0]
        return build(conn, scheduler_output)

    def slow_loads(conn: Any, jobs: Any, to_vllm: bool) -> None:
        if to_vllm:
            loading[0] = True
            time.sleep(1.0)
        copy(conn, jobs, to_vllm)
        loading[0] = False

    monkeypatch.setattr(KvprocConnector, "build_connector_meta", build_connector_meta)
    monkeypatch.setattr(KvprocConnector, "_copy", slow_loads)
    prompt = random_tokens(random.Random(11), 100)
    with engine(tiny_llama, kvproc_transfer_config(loads="async")) as llm:
        first = generate(llm, [prompt], max_tokens=4)
        assert live_runtime().moves.idle(60)
        # A finished request whose save was in flight keeps its blocks until vLLM hears the save settled, at a step:
        # one more short request makes that step (the direct path's saves, reserved in the tier, outlast a step).
        generate(llm, [[5, 6]], max_tokens=1)
        assert reset_prefix_cache(llm)  # vLLM forgets it: the next run loads the prompt's pages from kvproc
        again = generate(llm, [prompt], max_tokens=4)
        counters = dict(live_runtime().counters)
    assert again == first
    assert counters.get("loads_async", 0) > 0 and counters.get("idle_step_waits", 0) > 0, counters
    # The step that submits the load is idle (vLLM holds the request back) and waits in get_finished until it lands:
    # no step, or one if the mover started late, begins while it runs.
    assert idle["steps"] > 0 and idle["during_load"] <= 2, idle
