"""Behaviour every tiny model must show: its KV lives in (and only in) the kvproc arenas it declares."""

from __future__ import annotations

import pytest
import torch

from kvproc import KvModel, validate_layout
from kvproc.engine.models import (
    MODEL_NAMES,
    PAD_TOKEN_ID,
    SeqBatchItem,
    build_model,
)
from tests.engine.conftest import NUM_BLOCKS, NUM_SLOTS, copy_state, fresh, make, run, slots, tokens


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_declared_layout_validates_and_arenas_are_stable(name: str) -> None:
    seen: list[tuple[str, int]] = []

    def alloc(arena: str, nbytes: int) -> torch.Tensor:
        seen.append((arena, nbytes))
        return torch.zeros(nbytes, dtype=torch.uint8)

    model = build_model(name, num_blocks=NUM_BLOCKS, num_slots=NUM_SLOTS, allocator=alloc)
    assert isinstance(model, KvModel)
    layout = validate_layout(model.spec(), model.arenas(0))
    assert layout.num_paged_blocks == NUM_BLOCKS
    assert all(n == NUM_SLOTS for n in layout.bounded_slots.values())
    assert [a.name for _, a in model.arenas(0)] == [n for n, _ in seen]
    assert all(a1.tensor is a2.tensor for (_, a1), (_, a2) in zip(model.arenas(0), model.arenas(0)))
    assert model.spec().prefix_caching


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_chunked_prefill_matches_one_shot(name: str) -> None:
    model = make(name)
    toks = tokens(model, 150)
    one = run(model, toks, [0, 150], list(range(10)), fresh(model, 0))
    # Chunks of 1, 16, 73 (longer than the swa window) and 60 tokens, in other blocks and another slot.
    chunked = run(model, toks, [0, 1, 17, 90, 150], list(range(20, 30)), fresh(model, 1))
    torch.testing.assert_close(chunked, one, atol=1e-4, rtol=0)
    assert chunked.argmax() == one.argmax()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_decode_after_prefill_matches_one_shot_of_extended_sequence(name: str) -> None:
    model = make(name)
    toks = tokens(model, 40)
    blocks, sl = list(range(10)), fresh(model, 0)
    logits = run(model, toks, [0, 40], blocks, sl)
    seq = toks.tolist()
    for _ in range(6):  # greedy decode, one token a step
        seq.append(int(logits.argmax()))
        logits = model.forward([SeqBatchItem([seq[-1]], len(seq) - 1, blocks, sl)])[0]
    one = run(model, torch.tensor(seq), [0, len(seq)], list(range(20, 30)), fresh(model, 1))
    torch.testing.assert_close(logits, one, atol=1e-4, rtol=0)
    assert logits.argmax() == one.argmax()


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_restore_from_copied_bytes_continues_like_the_original(name: str) -> None:
    model = make(name)
    toks = tokens(model, 70)
    a_blocks, b_blocks = [3, 7, 11, 2, 30], [40, 5, 22, 9, 31]
    live, staging, new_live = 0, 4, 2
    sl_a = fresh(model, live)
    run(model, toks, [0, 20, 45], a_blocks, sl_a)  # prefix of 45 tokens: 2 full pages + a partial one
    # The destination holds garbage first: the copy alone must make it right.
    for group, arena in model.arenas(0):
        raw = arena.byte_view().view(arena.num_blocks, arena.block_stride)
        idx = new_live if model.spec().group(group).kind.value == "bounded" else torch.tensor(b_blocks[:3])
        raw[idx] = torch.randint(0, 256, raw[idx].shape, dtype=torch.uint8)
    copy_state(model, a_blocks[:3], b_blocks[:3], live, staging, new_live)
    sl_b = slots(model, new_live)
    got = [run(model, toks, [45, 63], b_blocks, sl_b), run(model, toks, [63, 64], b_blocks, sl_b)]
    want = [run(model, toks, [45, 63], a_blocks, sl_a), run(model, toks, [63, 64], a_blocks, sl_a)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=0)
        assert g.argmax() == w.argmax()
    # Negative control: without the restored bytes the continuation differs (the model really reads the arenas).
    for group, arena in model.arenas(0):
        raw = arena.byte_view().view(arena.num_blocks, arena.block_stride)
        raw[new_live if model.spec().group(group).kind.value == "bounded" else torch.tensor(b_blocks[:3])] = 0
    cold = run(model, toks, [45, 63], b_blocks, sl_b)
    assert (cold - want[0]).abs().max() > 1e-2


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_mixed_batch_matches_items_run_alone(name: str) -> None:
    model = make(name)
    toks = [tokens(model, 50, seed=s) for s in range(4)]
    tables = [list(range(i * 8, i * 8 + 8)) for i in range(4)]
    sls = [fresh(model, i) for i in range(4)]
    lens = [30, 41, 17, 0]
    for t, tb, s, n in zip(toks, tables, sls, lens):
        if n:
            run(model, t, [0, n], tb, s)
    # Three decode steps and one prefill chunk in one batch.
    items = [SeqBatchItem(toks[i][lens[i] : lens[i] + 1], lens[i], tables[i], sls[i]) for i in range(3)]
    items.append(SeqBatchItem(toks[3][:25], 0, tables[3], sls[3]))
    batched = model.forward(items)
    # Same work again, one item at a time, from copies of the pre-step state.
    model2 = make(name)
    for t, tb, s, n in zip(toks, tables, sls, lens):
        for g in s:
            model2.reset_slot(g, s[g])
        if n:
            run(model2, t, [0, n], tb, s)
    alone = torch.stack([model2.forward([it])[0] for it in items])
    torch.testing.assert_close(batched, alone, atol=1e-4, rtol=0)
    assert torch.equal(batched.argmax(-1), alone.argmax(-1))


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_same_seed_gives_identical_logits_across_instances(name: str) -> None:
    outs = []
    for seed in (0, 0, 1):
        model = make(name, seed=seed)
        outs.append(run(model, tokens(model, 33), [0, 20, 33], list(range(5)), fresh(model, 0)))
    assert torch.equal(outs[0], outs[1])
    assert not torch.allclose(outs[0], outs[2])
    assert outs[0].dtype == torch.float32 and outs[0].shape == (make(name).vocab_size,)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_bad_inputs_raise_value_error(name: str) -> None:
    model = make(name)
    sl = fresh(model, 0)
    for bad in ([PAD_TOKEN_ID], [-1], [model.vocab_size]):
        with pytest.raises(ValueError, match="outside"):
            model.forward([SeqBatchItem(bad, 0, [0], sl)])
    with pytest.raises(ValueError, match="block ids"):
        model.forward([SeqBatchItem(list(range(20)), 0, [0], sl)])
    if sl:
        with pytest.raises(ValueError, match="slot"):
            model.forward([SeqBatchItem([1], 0, [0], {})])
        with pytest.raises(ValueError, match="slot"):
            model.forward([SeqBatchItem([1], 0, [0], sl), SeqBatchItem([2], 0, [1], sl)])
    with pytest.raises(ValueError):
        model.forward([])
    assert 0 <= model.eos_token_id < model.vocab_size


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_reset_slot_zeroes_only_that_slot(name: str) -> None:
    model = make(name)
    if not model.spec().bounded_groups:
        with pytest.raises(ValueError):
            model.reset_slot(model.spec().groups[0].name, 0)
        return
    run(model, tokens(model, 20), [0, 20], list(range(2)), fresh(model, 1))
    run(model, tokens(model, 20), [0, 20], list(range(2, 4)), fresh(model, 2))
    for g in slots(model, 1):
        model.reset_slot(g, 1)
    for group, arena in model.arenas(0):
        if model.spec().group(group).kind.value == "bounded":
            raw = arena.byte_view().view(arena.num_blocks, arena.block_stride)
            assert not raw[1].any() and raw[2].any()
