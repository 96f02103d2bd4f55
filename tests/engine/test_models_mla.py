"""mla specifics: the 656-byte wire layout and its exact repack, the aligned indexer, optional MTP, the drafter."""

from __future__ import annotations

import pytest
import torch

from kvproc import ArenaId, RepackDirection, validate_layout
from kvproc.engine.models import SeqBatchItem
from kvproc.engine.models.wire import EXEC_ROW_BYTES, WIRE_ROW_BYTES
from tests.engine.conftest import PT, fresh, make, run, tokens

LATENT_ARENA = ArenaId("mla.L0.latent", 0)

SAVE, LOAD = RepackDirection.SAVE, RepackDirection.LOAD


def latent_arenas(model):  # type: ignore[no-untyped-def]
    return [a for g, a in model.arenas(0) if g == "latent"]


def test_latent_wire_rows_are_656_bytes_and_round_trip_bit_exact() -> None:
    model = make("mla")
    run(model, tokens(model, 40), [0, 40], [4, 9, 1], {})
    arenas = latent_arenas(model)
    assert EXEC_ROW_BYTES == 576 and WIRE_ROW_BYTES == 656
    for arena in arenas:
        assert arena.bytes_per_block == PT * 576 and arena.stored_bytes_per_block == PT * 656
        src = arena.byte_view().view(arena.num_blocks, -1)[torch.tensor([4, 9, 1])]
        wire = torch.empty(3, arena.stored_bytes, dtype=torch.uint8)
        model.repack("latent", SAVE, src, wire, LATENT_ARENA)
        rows = wire.view(-1, 656)
        assert torch.equal(rows[:, :576], src.view(-1, 576))  # payload verbatim, metadata after it
        assert rows[:, 576:].any()
        back = torch.zeros_like(src)
        model.repack("latent", LOAD, wire, back, LATENT_ARENA)
        assert torch.equal(back, src)
    # Several arenas' blocks laid end to end convert the same way (repack is per row).
    cat = torch.cat([a.byte_view().view(a.num_blocks, -1)[:2] for a in arenas], dim=1)
    wire = torch.empty(2, cat.shape[1] // 576 * 656, dtype=torch.uint8)
    model.repack("latent", SAVE, cat, wire, LATENT_ARENA)
    back = torch.empty_like(cat)
    model.repack("latent", LOAD, wire, back, LATENT_ARENA)
    assert torch.equal(back, cat)


def test_round_trip_is_exact_for_any_float_bits() -> None:
    model = make("mla")
    src = torch.randint(0, 256, (5, PT * 576), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    src.view(-1, 576)[0, :4] = torch.tensor([0, 0, 0xC0, 0x7F], dtype=torch.uint8)  # a NaN payload word
    wire = torch.empty(5, PT * 656, dtype=torch.uint8)
    model.repack("latent", SAVE, src, wire, LATENT_ARENA)
    back = torch.empty_like(src)
    model.repack("latent", LOAD, wire, back, LATENT_ARENA)
    assert torch.equal(back, src)


def test_corrupt_wire_row_fails_load_loudly() -> None:
    model = make("mla")
    src = torch.randn(2, PT * 144).view(torch.uint8).view(2, -1)
    wire = torch.empty(2, PT * 656, dtype=torch.uint8)
    model.repack("latent", SAVE, src, wire, LATENT_ARENA)
    wire[1, 700] ^= 1
    with pytest.raises(ValueError, match="checksum"):
        model.repack("latent", LOAD, wire, torch.empty_like(src), LATENT_ARENA)
    with pytest.raises(ValueError, match="dst"):
        model.repack("latent", SAVE, src, torch.empty(2, PT * 576, dtype=torch.uint8), LATENT_ARENA)


def test_restore_through_the_wire_layout_continues_like_the_original() -> None:
    model = make("mla", mtp=True)
    toks = tokens(model, 60)
    a, b = [2, 5, 8, 11], [20, 21, 22, 23]
    run(model, toks, [0, 48], a, {})
    for group, arena in model.arenas(0):
        raw = arena.byte_view().view(arena.num_blocks, arena.block_stride)
        stored = torch.empty(3, arena.stored_bytes, dtype=torch.uint8)
        ident = validate_layout(model.spec(), model.arenas(0)).arena_id(arena.name)
        model.repack(group, SAVE, raw[torch.tensor(a[:3])], stored, ident)  # every save repacks
        dst = torch.empty(3, arena.bytes_per_block, dtype=torch.uint8)
        model.repack(group, LOAD, stored, dst, ident)  # and every load
        raw[torch.tensor(b[:3])] = dst
    got = run(model, toks, [48, 60], b, {})
    want = run(model, toks, [48, 60], a, {})
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_indexer_keys_are_read_from_their_aligned_group() -> None:
    model = make("mla")
    toks = tokens(model, 40)
    run(model, toks, [0, 32], [0, 1, 2], {})
    want = run(model, toks, [32, 40], [0, 1, 2], {})
    for group, arena in model.arenas(0):
        if group == "indexer":
            arena.byte_view().view(arena.num_blocks, -1)[torch.tensor([0, 1])] = 0
    got = run(model, toks, [32, 40], [0, 1, 2], {})
    assert (got - want).abs().max() > 1e-3


def test_mtp_group_is_optional_and_never_changes_main_logits() -> None:
    plain, with_mtp = make("mla"), make("mla", mtp=True)
    g = with_mtp.spec().group("mtp")
    assert g.optional and g.kind.value == "paged" and with_mtp.spec().prefix_caching
    validate_layout(with_mtp.spec(), with_mtp.arenas(0))
    toks = tokens(plain, 30)
    want = run(plain, toks, [0, 30], [0, 1], {})
    assert torch.equal(run(with_mtp, toks, [0, 30], [0, 1], {}), want)
    assert with_mtp.last_mtp_draft is not None
    # A checkpoint restored without the MTP group (its blocks left zero) still gives the same main logits.
    for group, arena in with_mtp.arenas(0):
        if group == "mtp":
            arena.byte_view().zero_()
    assert torch.equal(run(with_mtp, toks, [0, 30], [0, 1], {}), want)


def test_drafter_turns_prefix_caching_off_with_a_reason_naming_it() -> None:
    assert make("mla").spec().prefix_caching
    model = make("mla", drafter=True, mtp=True)
    spec = model.spec()
    g = spec.group("drafter")
    assert g.kind.value == "bounded" and not g.checkpointable and not g.optional
    assert spec.prefix_caching is False
    assert spec.prefix_caching_off_reason is not None and "drafter" in spec.prefix_caching_off_reason
    validate_layout(spec, model.arenas(0))
    sl = fresh(model, 3)
    out = model.forward([SeqBatchItem(tokens(model, 10), 0, [0], sl)])
    assert out.shape == (1, model.vocab_size) and model.last_drafter_draft is not None
    with pytest.raises(ValueError, match="drafter"):
        model.forward([SeqBatchItem([1], 10, [0], {})])


def test_groups_without_a_wire_layout_repack_by_copy() -> None:
    model = make("mla")
    src = torch.randint(0, 256, (2, 100), dtype=torch.uint8)
    dst = torch.empty_like(src)
    model.repack("indexer", SAVE, src, dst, ArenaId("mla.L0.index_k", 0))
    assert torch.equal(dst, src)
