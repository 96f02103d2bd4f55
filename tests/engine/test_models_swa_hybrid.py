"""Bounded-state specifics of swa (the sliding-window ring) and hybrid (recurrent + conv state, two arenas)."""

from __future__ import annotations

import torch

from kvproc.engine.models import SeqBatchItem
from kvproc.engine.models.layers import StepCtx
from tests.engine.conftest import copy_state, fresh, make, run, tokens


def test_swa_ring_holds_the_last_window_at_position_mod_window() -> None:
    model = make("swa", window=32)
    toks = tokens(model, 100)
    sl = fresh(model, 0)
    run(model, toks, [0, 100], list(range(7)), sl)  # one chunk of 100 tokens, longer than the window
    layer0 = model.blocks[0].mixer  # a local layer; its input is the embedding, so K/V depend on token+position
    ctx = StepCtx.build(model._prepare([SeqBatchItem(toks, 0, list(range(7)), sl)]))
    _, k, v = layer0.proj.qkv(model.head.embed_tokens(ctx), ctx)  # type: ignore[attr-defined]
    rows = torch.cat([k.flatten(1), v.flatten(1)], dim=1)
    ring = layer0.ring[0]  # type: ignore[attr-defined]
    for p in range(68, 100):
        torch.testing.assert_close(ring[p % 32], rows[p], atol=1e-6, rtol=0)


def test_swa_restored_ring_and_pages_continue_like_the_original() -> None:
    # A restored ring (seal-by-copy through a staging slot) plus the copied pages is all a continuation needs.
    model = make("swa", window=32)
    toks = tokens(model, 90)
    run(model, toks, [0, 50], list(range(6)), fresh(model, 0))
    copy_state(model, list(range(4)), list(range(20, 24)), 0, 5, 3)
    got = run(model, toks, [50, 90], list(range(20, 26)), {"swa": 3})
    want = run(model, toks, [50, 90], list(range(6)), {"swa": 0})
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_hybrid_bounded_group_has_a_recurrent_and_a_conv_arena() -> None:
    model = make("hybrid")
    arenas = [a.name for g, a in model.arenas(0) if g == "linear"]
    assert arenas == ["hybrid.recurrent", "hybrid.conv"]
    sl = fresh(model, 2)
    model.forward([SeqBatchItem(tokens(model, 5), 0, [0], sl)])
    for g, a in model.arenas(0):
        if g == "linear":
            assert a.byte_view().view(a.num_blocks, -1)[2].any()


def test_hybrid_recurrence_is_exact_token_by_token_versus_long_chunks() -> None:
    model = make("hybrid")
    toks = tokens(model, 200)  # > one 64-token sub-chunk of the chunkwise recurrence
    one = run(model, toks, [0, 200], list(range(13)), fresh(model, 0))
    steps = run(model, toks, [0, 130] + list(range(131, 201)), list(range(20, 33)), fresh(model, 1))
    torch.testing.assert_close(steps, one, atol=1e-4, rtol=0)
