"""The connector with `mover="cma"`: kvproc's copy worker process moves the blocks, reading and writing vLLM's own
(private) KV tensors by cross-memory attach. Same tokens as vLLM alone; after a reset, hits served from kvproc's
host tier with the same tokens; the copy worker counted the bytes it moved."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integrations.vllm.conftest import (
    engine,
    generate,
    kvproc_transfer_config,
    live_runtime,
    metrics,
    multi_turn,
    random_tokens,
    reset_prefix_cache,
)

pytestmark = pytest.mark.timeout(600)


def test_cma_mover_same_tokens_and_host_hits(tiny_llama: Path,
                                             reference: list[tuple[list[int], list[int]]]) -> None:
    import random

    with engine(tiny_llama, kvproc_transfer_config(mover="cma")) as llm:
        got = multi_turn(llm)
        assert [o for _, o in got] == [o for _, o in reference]
        rng = random.Random(21)
        generate(llm, [random_tokens(rng, 220) for _ in range(6)], max_tokens=4)  # out of the staging pool
        assert reset_prefix_cache(llm)
        rt = live_runtime()
        c0, before = dict(rt.counters), metrics(llm)
        outs = generate(llm, [p for p, _ in reference[-4:]])
        assert outs == [o for _, o in reference[-4:]]
        assert metrics(llm)["vllm:external_prefix_cache_hits"] > before["vllm:external_prefix_cache_hits"]
        assert rt.counters.get("hit_tokens_host", 0) > c0.get("hit_tokens_host", 0)
        worker = rt.cluster.cluster.client("copy_worker", 0)
        from kvproc.ipc import messages as m

        stats = worker.request(m.Stats(), timeout=10.0)
        moved = {k: v for k, v in stats.counters.items() if k.endswith("_engine")}
        assert moved.get("orders_engine", 0) > 0 and moved.get("bytes_engine", 0) > 0
