"""The KV contract validates at construction and names the field and the value in every error."""

import pytest
import torch

from kvproc import (
    ArenaId,
    GroupKind,
    GroupSpec,
    KvArena,
    KvContractError,
    KvModel,
    KvSpec,
    RepackDirection,
    validate_layout,
)

P, B = GroupKind.PAGED, GroupKind.BOUNDED


def arena(name: str, blocks: int = 4, bpb: int = 64, stride: int = 64, nbytes: int | None = None) -> KvArena:
    size = nbytes if nbytes is not None else blocks * stride
    return KvArena(name, torch.zeros(size, dtype=torch.uint8), blocks, bpb, stride)


def test_empty_groups_are_rejected():
    with pytest.raises(KvContractError, match="groups is empty"):
        KvSpec(16, ())


def test_duplicate_group_names_are_rejected_by_name():
    with pytest.raises(KvContractError, match="duplicate group name 'kv'"):
        KvSpec(16, (GroupSpec("kv", P), GroupSpec("kv", P)))


def test_empty_group_name_is_rejected():
    with pytest.raises(KvContractError, match="name"):
        GroupSpec("", P)


@pytest.mark.parametrize("bad", [0, -16, 12, 3, 1.5, True])
def test_page_size_must_be_a_positive_power_of_two(bad):
    with pytest.raises(KvContractError, match=f"page_tokens.*{bad!r}"):
        KvSpec(bad, (GroupSpec("kv", P),))


def test_arena_for_unknown_group_is_rejected():
    spec = KvSpec(16, (GroupSpec("kv", P),))
    with pytest.raises(KvContractError, match="unknown group 'nope'"):
        validate_layout(spec, [("kv", arena("a")), ("nope", arena("b"))])


def test_zero_blocks_is_rejected():
    with pytest.raises(KvContractError, match="num_blocks must be a positive int, got 0"):
        arena("a", blocks=0, nbytes=64)


def test_bytes_per_block_above_stride_is_rejected():
    with pytest.raises(KvContractError, match="bytes_per_block=128 exceeds block_stride=64"):
        arena("a", bpb=128, stride=64, nbytes=1024)


def test_tensor_smaller_than_last_block_end_is_rejected():
    # (4-1)*64 + 64 = 256 bytes needed
    with pytest.raises(KvContractError, match="holds 255 bytes.*= 256"):
        arena("a", nbytes=255)


def test_tensor_exactly_last_block_end_is_accepted():
    a = KvArena("a", torch.zeros(3 * 100 + 64, dtype=torch.uint8), 4, 64, 100)
    assert a.byte_view().numel() == 364


def test_aligned_paged_arenas_with_different_block_counts_are_rejected():
    spec = KvSpec(16, (GroupSpec("latent", P), GroupSpec("indexer", P)))
    with pytest.raises(KvContractError, match="num_blocks differ"):
        validate_layout(spec, [("latent", arena("l0", blocks=4)), ("indexer", arena("i0", blocks=5))])


def test_bounded_group_without_arena_is_rejected():
    spec = KvSpec(16, (GroupSpec("kv", P), GroupSpec("ring", B)))
    with pytest.raises(KvContractError, match="bounded group 'ring' has no arena"):
        validate_layout(spec, [("kv", arena("a"))])


def test_non_checkpointable_required_group_turns_prefix_caching_off_with_a_reason():
    spec = KvSpec(16, (GroupSpec("kv", P), GroupSpec("drafter", B, checkpointable=False)))
    assert spec.prefix_caching is False
    assert "drafter" in (spec.prefix_caching_off_reason or "")


def test_non_checkpointable_optional_group_keeps_prefix_caching():
    spec = KvSpec(16, (GroupSpec("kv", P), GroupSpec("drafter", B, checkpointable=False, optional=True)))
    assert spec.prefix_caching and spec.prefix_caching_off_reason is None
    assert spec.restorable_bounded_groups == ()


def test_valid_layout_reports_block_space_and_slots():
    spec = KvSpec(16, (GroupSpec("kv", P), GroupSpec("state", B)))
    layout = validate_layout(
        spec, [("kv", arena("k0", blocks=8)), ("kv", arena("k1", blocks=8)), ("state", arena("s0", blocks=3)),
               ("state", arena("s1", blocks=3, bpb=16, stride=16))]
    )
    assert layout.num_paged_blocks == 8
    assert layout.bounded_slots == {"state": 3}
    assert layout.stored_bytes_per_block("kv") == 128
    assert layout.stored_bytes_per_block("state") == 80


def test_default_repack_copies_bytes():
    class M:
        def spec(self):
            return KvSpec(16, (GroupSpec("kv", P),))

        def arenas(self, rank):
            return [("kv", arena("a"))]

        repack = KvModel.repack

    m = M()
    assert isinstance(m, KvModel)
    src, dst = torch.arange(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    m.repack("kv", RepackDirection.SAVE, src, dst, ArenaId("a", 0))
    assert torch.equal(src, dst)
