"""Where the engine's checkpoint policy puts bounded checkpoints and how it cuts prefill chunks for them."""

from __future__ import annotations

from kvproc.engine.checkpoints import CheckpointPolicy

P = 16
POL = CheckpointPolicy(P, every_pages=2)  # a checkpoint every 32 tokens and at turn end


def test_turn_end_is_the_last_page_boundary_the_turn_computes() -> None:
    assert POL.turn_end_pages(100, 20) == 7  # computes 119 tokens: last boundary 112
    assert POL.turn_end_pages(96, 1) == 6  # computes exactly 96


def test_due_every_n_pages_and_at_turn_end_only() -> None:
    assert [p for p in range(1, 9) if POL.due(p, 7)] == [2, 4, 6, 7, 8]


def test_non_final_prefill_chunk_is_cut_back_to_the_deepest_due_boundary() -> None:
    assert POL.prefill_chunk(0, 500, 100, 40, bounded=True) == 96
    assert POL.prefill_chunk(40, 500, 100, 40, bounded=True) == 88  # 40 -> 128
    assert POL.prefill_chunk(0, 500, 100, 40, bounded=False) == 100  # paged-only: pages seal in place, no cut


def test_final_prefill_chunk_is_cut_only_at_a_turn_end_inside_the_prompt() -> None:
    assert POL.prefill_chunk(0, 70, 100, POL.turn_end_pages(70, 40), bounded=True) == 70  # turn end in decode
    assert POL.prefill_chunk(0, 70, 100, POL.turn_end_pages(70, 2), bounded=True) == 64  # short output
