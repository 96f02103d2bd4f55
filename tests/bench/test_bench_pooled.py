"""`kvproc bench pooled`: node-local host tiers vs a shared remote tier, against hand-computed hit ratios."""

from pathlib import Path

import pytest

from kvproc.bench.pooled import pooled
from kvproc.bench.replay import load_trace, synth_tokens
from kvproc.core.hashing import BlockHasher

TINY = Path(__file__).parent.parent / "data" / "trace_tiny.jsonl"


def _hashed() -> list[tuple[list[bytes], int]]:
    hasher = BlockHasher(512)
    return [(list(hasher.hash_prompt(synth_tokens(r.hash_ids))), r.input_length) for r in load_trace(TINY)]


def test_two_nodes_local_only_lose_the_hits_the_pooled_tier_keeps() -> None:
    hashed = _hashed()
    # One node (or a pooled tier) sees every earlier prompt: r1 hits [0,1], r2 [0], r3 [0,1,2] -> 3072 of 5600 tokens.
    assert pooled(hashed, 1, 100, None, 512)["token_hit_ratio"] == pytest.approx(3072 / 5600, abs=1e-4)
    # Round robin over two nodes, local only: r1 (node 1) nothing, r2 (node 0) [0] of r0, r3 (node 1) [0,1] of r1.
    assert pooled(hashed, 2, 100, None, 512)["token_hit_ratio"] == pytest.approx(1536 / 5600, abs=1e-4)
    both = pooled(hashed, 2, 100, 100, 512)
    assert both["token_hit_ratio"] == pytest.approx(3072 / 5600, abs=1e-4)
    assert both["local_part"] == pytest.approx(1536 / 5600, abs=1e-4)
