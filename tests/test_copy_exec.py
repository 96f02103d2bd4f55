"""The copy path moves exactly the right bytes: coalesced runs, scattered ids, bounded slots, repack, bad ids."""

import numpy as np
import pytest
import torch

from kvproc import GroupKind, GroupSpec, KvArena, KvSpec, RepackDirection, validate_layout
from kvproc.tiers.layout import HostLayout
from kvproc.workers.copy_exec import CopyError, CopyExecutor, runs
from kvproc.workers.orders import BoundedCopy, LoadOrder, SaveOrder, SlotCopy


def test_runs_coalesce_only_where_both_sides_advance_together():
    src = np.array([3, 4, 5, 9, 10, 2])
    dst = np.array([0, 1, 7, 8, 9, 3])
    assert runs(src, dst) == [(3, 0, 2), (5, 7, 1), (9, 8, 2), (2, 3, 1)]


def layout(nb=8, bpb=32, stride=48, slots=4, stored=None):
    spec = KvSpec(4, (GroupSpec("kv", GroupKind.PAGED), GroupSpec("st", GroupKind.BOUNDED)))
    arenas = [
        ("kv", KvArena("k0", torch.randint(0, 255, (nb * stride,), dtype=torch.uint8), nb, bpb, stride,
                       stored_bytes_per_block=stored)),
        ("kv", KvArena("k1", torch.randint(0, 255, (nb * bpb,), dtype=torch.uint8), nb, bpb, bpb)),
        ("st", KvArena("s0", torch.randint(0, 255, (slots * 16,), dtype=torch.uint8), slots, 16, 16)),
    ]
    return validate_layout(spec, arenas)


def block(a: KvArena, i: int) -> torch.Tensor:
    return a.byte_view()[i * a.block_stride : i * a.block_stride + a.bytes_per_block]


def test_save_then_load_into_other_ids_is_bit_exact_for_every_arena():
    lay = layout()
    hl = HostLayout.plan(lay, 1 << 16)
    host = np.zeros(hl.total_bytes, dtype=np.uint8)
    ex = CopyExecutor(lay, host, hl)
    before = {a.name: [block(a, i).clone() for i in range(a.num_blocks)] for _, a in lay.arenas}
    ex.save(SaveOrder("r", [0, 1, 2, 6], [5, 6, 7, 1], [BoundedCopy("st", 2, 3)]))
    ex.load(LoadOrder("r", [5, 6, 7, 1], [4, 5, 3, 7], [BoundedCopy("st", 0, 3)]))
    for _, a in lay.arenas:
        if a.name == "s0":
            assert torch.equal(block(a, 0), before["s0"][2])
        else:
            for src, dst in zip([0, 1, 2, 6], [4, 5, 3, 7]):
                assert torch.equal(block(a, dst), before[a.name][src])


def test_stride_padding_is_not_copied():
    lay = layout()
    hl = HostLayout.plan(lay, 1 << 16)
    ex = CopyExecutor(lay, np.zeros(hl.total_bytes, dtype=np.uint8), hl)
    k0 = lay.arenas[0][1]
    pad = k0.byte_view()[32:48].clone()
    ex.save(SaveOrder("r", [1], [0]))
    ex.load(LoadOrder("r", [0], [0]))
    assert torch.equal(k0.byte_view()[32:48], pad)


def test_device_copy_moves_a_whole_bounded_slot():
    lay = layout()
    ex = CopyExecutor(lay)
    s0 = lay.arenas[2][1]
    want = block(s0, 1).clone()
    ex.device_copy([SlotCopy("st", 1, 3)])
    assert torch.equal(block(s0, 3), want)


def test_repack_runs_on_save_and_load_and_round_trips():
    calls = []

    def repack(group, direction, src, dst):
        calls.append(direction)
        if direction is RepackDirection.SAVE:
            dst[:, :32] = src
            dst[:, 32:] = 0xAB
        else:
            assert (src[:, 32:] == 0xAB).all()
            dst.copy_(src[:, :32])

    lay = layout(stored=40)
    hl = HostLayout.plan(lay, 1 << 16)
    ex = CopyExecutor(lay, np.zeros(hl.total_bytes, dtype=np.uint8), hl, repack=repack)
    k0 = lay.arenas[0][1]
    want = block(k0, 2).clone()
    ex.save(SaveOrder("r", [2], [0]))
    block(k0, 2).zero_()
    ex.load(LoadOrder("r", [0], [2]))
    assert torch.equal(block(k0, 2), want) and calls == [RepackDirection.SAVE, RepackDirection.LOAD]


def test_out_of_range_ids_are_refused_before_any_byte_moves():
    lay = layout()
    hl = HostLayout.plan(lay, 1 << 16)
    host = np.zeros(hl.total_bytes, dtype=np.uint8)
    ex = CopyExecutor(lay, host, hl)
    with pytest.raises(CopyError, match="out of range"):
        ex.save(SaveOrder("r", [0, 99], [0, 1]))
    assert not host.any()
