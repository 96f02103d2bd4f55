"""One copy per restored page and one per saved page (issue 34): the connector moves bytes between vLLM's blocks and
the host tier's slots, nothing through a bridge of kvproc's or its copy worker.

Counted on both sides of each copy: the connector's mover (`pages_loaded_into_vllm` / `pages_saved_from_vllm`: each a
copy between vLLM's block and kvproc's side) and kvproc's copy worker (`bytes_load` / `bytes_save`: a hop through it).
The control copies every load twice (as the staging pool's hop did, removed at stop 48): the same one-copy check
fails.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integrations.vllm.conftest import (
    engine,
    generate,
    control_copy_loads_twice,
    kvproc_transfer_config,
    live_runtime,
    metrics,
    multi_turn,
    reset_prefix_cache,
)

pytestmark = pytest.mark.timeout(600)


def _copy_worker(rt: Any) -> dict[str, int]:
    from kvproc.ipc import messages as m

    stats = rt.cluster.cluster.client("copy_worker", 0).request(m.Stats(), timeout=10.0)
    return {k: int(v) for k, v in stats.counters.items()}


def _replay(llm: Any, reference: list[tuple[list[int], list[int]]]) -> dict[str, float]:
    """The last turn served from the host tier only (vLLM's cache reset): the copies each restored page and each
    saved page took, and the tokens."""
    rt = live_runtime()
    multi_turn(llm)  # every page saved
    assert rt.moves is not None and rt.moves.idle(60)
    assert reset_prefix_cache(llm)
    c0, w0, m0 = dict(rt.counters), _copy_worker(rt), metrics(llm)
    outs = generate(llm, [p for p, _ in reference[-4:]])
    assert outs == [o for _, o in reference[-4:]]
    c1, w1, m1 = dict(rt.counters), _copy_worker(rt), metrics(llm)
    page = rt.contract.block_tokens
    restored = (m1["vllm:external_prefix_cache_hits"] - m0["vllm:external_prefix_cache_hits"]) // page
    assert restored > 0 and c1.get("hit_tokens_host", 0) > c0.get("hit_tokens_host", 0)
    page_bytes = sum(g.bytes_per_block * len(g.layer_names) for g in rt.contract.groups)
    by_mover = c1.get("pages_loaded_into_vllm", 0) - c0.get("pages_loaded_into_vllm", 0)
    by_worker = (w1.get("bytes_load", 0) - w0.get("bytes_load", 0)) / page_bytes
    return {"restored": restored, "load_copies": (by_mover + by_worker) / restored,
            "save_hop_bytes": w1.get("bytes_save", 0), "layout_blocks": rt.model.arenas(0)[0][1].num_blocks}


def test_each_restored_page_is_copied_once_and_no_page_goes_through_a_bridge(
        tiny_llama: Path, reference: list[tuple[list[int], list[int]]]) -> None:
    with engine(tiny_llama, kvproc_transfer_config()) as llm:
        got = _replay(llm, reference)
    assert got["load_copies"] == 1.0, got
    assert got["save_hop_bytes"] == 0, got  # every saved page: vLLM's block -> the tier's slot, by the mover only
    assert got["layout_blocks"] == 1, got  # kvproc's own arenas in the engine: one block each (the tier's layout)


def test_control_a_second_copy_per_restored_page_is_counted(
        tiny_llama: Path, reference: list[tuple[list[int], list[int]]], monkeypatch: pytest.MonkeyPatch) -> None:
    control_copy_loads_twice(monkeypatch)
    with engine(tiny_llama, kvproc_transfer_config()) as llm:
        got = _replay(llm, reference)
    assert got["load_copies"] == 2.0, got  # the check above fails here: the hop is back
