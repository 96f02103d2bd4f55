"""The copy path moves exactly the right bytes: coalesced runs, scattered ids, bounded slots, repack, bad ids.

The executor tests run over both CPU movers: `memmove` (the numpy/native paths over host views) and `torch` (the
tensor executor, `kvproc/workers/tensor_exec.py`: the GPU path's logic on CPU tensors). Same bytes, same errors."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvproc import GroupKind, GroupSpec, KvArena, KvSpec, RepackDirection, validate_layout
from kvproc.ipc.orders import BoundedCopy, LoadOrder, SaveOrder, SlotCopy
from kvproc.tiers.layout import HostLayout
from kvproc.workers.copy_exec import CopyError, CopyExecutor, _runs_numpy, runs
from kvproc.workers.movers import mover_for
from tests.hypothesis_budget import examples

KINDS = pytest.mark.parametrize("kind", ["memmove", "torch"])


def mv(kind: str):  # type: ignore[no-untyped-def]
    return mover_for("cpu", kind=kind)


def test_runs_coalesce_only_where_both_sides_advance_together():
    src = np.array([3, 4, 5, 9, 10, 2])
    dst = np.array([0, 1, 7, 8, 9, 3])
    assert runs(src, dst) == [(3, 0, 2), (5, 7, 1), (9, 8, 2), (2, 3, 1)]


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), max_size=80))
def test_runs_small_list_path_and_numpy_path_agree_and_cover_every_pair(pairs):
    """Up to SMALL_ORDER pairs `runs` loops in Python, above it numpy: both must give the same maximal runs."""
    src = [s for s, _ in pairs]
    dst = [d for _, d in pairs]
    got = runs(src, dst)
    assert got == _runs_numpy(src, dst) == runs(np.asarray(src), np.asarray(dst))
    expanded = [(s0 + i, d0 + i) for s0, d0, k in got for i in range(k)]
    assert expanded == list(zip(src, dst))  # every pair, in order
    for (s0, d0, k), (s1, d1, _) in zip(got, got[1:]):
        assert not (s1 == s0 + k and d1 == d0 + k)  # maximal: no two neighbours could merge


def layout(nb=8, bpb=32, stride=48, slots=4, stored=None):
    spec = KvSpec(4, (GroupSpec("kv", GroupKind.PAGED), GroupSpec("st", GroupKind.BOUNDED)))
    arenas = [
        ("kv", KvArena("k0", torch.randint(0, 255, (nb * stride,), dtype=torch.uint8), nb, bpb, stride,
                       stored_bytes_per_block=stored, stored_layout="test-wide-v1" if stored else None)),
        ("kv", KvArena("k1", torch.randint(0, 255, (nb * bpb,), dtype=torch.uint8), nb, bpb, bpb)),
        ("st", KvArena("s0", torch.randint(0, 255, (slots * 16,), dtype=torch.uint8), slots, 16, 16)),
    ]
    return validate_layout(spec, arenas)


def block(a: KvArena, i: int) -> torch.Tensor:
    return a.byte_view()[i * a.block_stride : i * a.block_stride + a.bytes_per_block]


@KINDS
def test_save_then_load_into_other_ids_is_bit_exact_for_every_arena(kind):
    lay = layout()
    hl = HostLayout.plan(lay, 1 << 16)
    host = np.zeros(hl.total_bytes, dtype=np.uint8)
    ex = CopyExecutor(lay, host, hl, mover=mv(kind))
    before = {a.name: [block(a, i).clone() for i in range(a.num_blocks)] for _, a in lay.arenas}
    ex.save(SaveOrder("r", [0, 1, 2, 6], [5, 6, 7, 1], [BoundedCopy("st", 2, 3)]))
    ex.load(LoadOrder("r", [5, 6, 7, 1], [4, 5, 3, 7], [BoundedCopy("st", 0, 3)]))
    for _, a in lay.arenas:
        if a.name == "s0":
            assert torch.equal(block(a, 0), before["s0"][2])
        else:
            for src, dst in zip([0, 1, 2, 6], [4, 5, 3, 7]):
                assert torch.equal(block(a, dst), before[a.name][src])


@KINDS
@settings(max_examples=examples(60), deadline=None)
@given(data=st.data())
def test_any_mix_of_runs_and_scattered_ids_moves_exactly_the_right_bytes(data, kind):
    """Long runs go as slice copies, the rest as one gather per arena (`split_runs`): for any id pattern, small
    (Python planning) or large (numpy planning), every block lands where its order says, and the strided arena's
    padding between blocks is never written."""
    nb = 96
    lay = layout(nb=nb, slots=4)
    hl = HostLayout.plan(lay, 1 << 20)
    ex = CopyExecutor(lay, np.zeros(hl.total_bytes, dtype=np.uint8), hl, mover=mv(kind))
    def distinct(hi: int, n: int) -> list[int]:
        return data.draw(st.lists(st.integers(0, hi - 1), min_size=n, max_size=n, unique=True))

    n = data.draw(st.integers(0, 48))
    ids = list(range(n)) if data.draw(st.booleans()) else distinct(nb, n)
    slots = list(range(10, 10 + n)) if data.draw(st.booleans()) else distinct(hl.page_slots, n)
    dest = list(range(nb - n, nb)) if data.draw(st.booleans()) else distinct(nb, n)
    k0 = lay.arenas[0][1]
    before = {a.name: [block(a, i).clone() for i in range(a.num_blocks)] for _, a in lay.arenas[:2]}
    pads = k0.byte_view().view(nb, 48)[:, 32:].clone()
    ex.save(SaveOrder("r", ids, slots))
    ex.load(LoadOrder("r", slots, dest))
    for _, a in lay.arenas[:2]:
        for src, dst in zip(ids, dest):
            assert torch.equal(block(a, dst), before[a.name][src])
    assert torch.equal(k0.byte_view().view(nb, 48)[:, 32:], pads)


@KINDS
def test_stride_padding_is_not_copied(kind):
    lay = layout()
    hl = HostLayout.plan(lay, 1 << 16)
    ex = CopyExecutor(lay, np.zeros(hl.total_bytes, dtype=np.uint8), hl, mover=mv(kind))
    k0 = lay.arenas[0][1]
    pad = k0.byte_view()[32:48].clone()
    ex.save(SaveOrder("r", [1], [0]))
    ex.load(LoadOrder("r", [0], [0]))
    assert torch.equal(k0.byte_view()[32:48], pad)


@KINDS
def test_device_copy_moves_a_whole_bounded_slot(kind):
    lay = layout()
    ex = CopyExecutor(lay, mover=mv(kind))
    s0 = lay.arenas[2][1]
    want = block(s0, 1).clone()
    ex.device_copy([SlotCopy("st", 1, 3)])
    assert torch.equal(block(s0, 3), want)
    before = s0.byte_view().clone()
    for bad in ([SlotCopy("st", 0, 2), SlotCopy("st", 1, 4)], [SlotCopy("st", -1, 2)]):  # slot 4 is past 4 slots
        with pytest.raises(CopyError, match="out of range"):
            ex.device_copy(bad)
        assert torch.equal(s0.byte_view(), before)  # nothing half-applied (the good first copy did not run)
    with pytest.raises(CopyError, match="no arena"):
        ex.device_copy([SlotCopy("nope", 0, 1)])


@KINDS
def test_repack_runs_on_save_and_load_and_round_trips(kind):
    calls = []

    def repack(group, direction, src, dst, arena):
        calls.append(direction)
        if direction is RepackDirection.SAVE:
            dst[:, :32] = src
            dst[:, 32:] = 0xAB
        else:
            assert (src[:, 32:] == 0xAB).all()
            dst.copy_(src[:, :32])

    lay = layout(stored=40)
    hl = HostLayout.plan(lay, 1 << 16)
    ex = CopyExecutor(lay, np.zeros(hl.total_bytes, dtype=np.uint8), hl, repack=repack, mover=mv(kind))
    k0 = lay.arenas[0][1]
    want = block(k0, 2).clone()
    ex.save(SaveOrder("r", [2], [0]))
    block(k0, 2).zero_()
    ex.load(LoadOrder("r", [0], [2]))
    assert torch.equal(block(k0, 2), want) and calls == [RepackDirection.SAVE, RepackDirection.LOAD]


@KINDS
def test_bad_ids_or_a_length_mismatch_are_refused_before_any_byte_moves(kind):
    lay = layout()
    hl = HostLayout.plan(lay, 1 << 16)
    host = np.zeros(hl.total_bytes, dtype=np.uint8)
    ex = CopyExecutor(lay, host, hl, mover=mv(kind))
    with pytest.raises(CopyError, match="out of range"):
        ex.save(SaveOrder("r", [0, 99], [0, 1]))  # a device block past the arena
    with pytest.raises(CopyError, match="out of range"):
        ex.save(SaveOrder("r", [0, 1], [0, hl.page_slots]))  # a host slot past the region
    with pytest.raises(CopyError, match="2 device blocks against 1 host slots"):
        ex.save(SaveOrder("r", [0, 1], [0]))
    with pytest.raises(CopyError, match="arena s0: ids out of range"):  # good pages, a bad bounded slot
        ex.save(SaveOrder("r", [0, 1], [0, 1], [BoundedCopy("st", 0, 0), BoundedCopy("st", 9, 1)]))
    assert not host.any()
    k1 = lay.arenas[1][1]
    want = k1.byte_view().clone()
    with pytest.raises(CopyError, match="out of range"):
        ex.load(LoadOrder("r", [0, hl.page_slots], [1, 2]))
    assert torch.equal(k1.byte_view(), want)
    assert ex.save(SaveOrder("r", [], [])) == 0


@KINDS
def test_an_order_big_enough_for_two_copy_threads_is_split_and_lands_whole(kind):
    """Above `PARALLEL_BYTES` the executor halves the bytes across its two threads (cutting one job's ids where the
    half falls): every block still lands where the order says, on the compiled path and the fallback alike."""
    from kvproc.workers import copy_exec

    nb, bpb = 96, 128 << 10  # 12 MiB per arena: over the 8 MiB threshold
    spec = KvSpec(4, (GroupSpec("kv", GroupKind.PAGED),))
    lay = validate_layout(spec, [("kv", KvArena("k0", torch.randint(0, 255, (nb * bpb,), dtype=torch.uint8), nb,
                                                 bpb, bpb))])
    assert nb * bpb > copy_exec.PARALLEL_BYTES
    hl = HostLayout.plan(lay, nb * bpb + (1 << 20))
    ex = CopyExecutor(lay, np.zeros(hl.total_bytes, dtype=np.uint8), hl, threads=2, mover=mv(kind))
    k0 = lay.arenas[0][1]
    before = [block(k0, i).clone() for i in range(nb)]
    ids = np.random.default_rng(3).permutation(nb).tolist()
    assert ex.save(SaveOrder("r", ids, list(range(nb)))) == nb * bpb
    dest = np.random.default_rng(4).permutation(nb).tolist()
    assert ex.load(LoadOrder("r", list(range(nb)), dest)) == nb * bpb
    for src, dst in zip(ids, dest):  # slot i holds block ids[i] and loads into dest[i]
        assert torch.equal(block(k0, dst), before[src])
    ex.close()


@KINDS
def test_a_block_id_past_the_arena_is_refused_even_where_its_tensor_has_room_for_it(kind):
    """An arena tensor longer than its blocks: the compiled copy alone would accept id == num_blocks (its bytes fit in
    the buffer), so the executor checks the ids against the arena's block count itself before any byte moves."""
    nb, bpb = 8, 32
    spec = KvSpec(4, (GroupSpec("kv", GroupKind.PAGED),))
    lay = validate_layout(spec, [("kv", KvArena("k0", torch.zeros(nb * bpb + 4 * bpb, dtype=torch.uint8), nb, bpb,
                                                 bpb))])
    hl = HostLayout.plan(lay, 1 << 16)
    host = np.ones(hl.total_bytes, dtype=np.uint8)
    ex = CopyExecutor(lay, host, hl, mover=mv(kind))
    tail = lay.arenas[0][1].byte_view()[nb * bpb :].clone()
    with pytest.raises(CopyError, match="out of range"):
        ex.load(LoadOrder("r", [0, 1], [0, nb]))
    assert torch.equal(lay.arenas[0][1].byte_view()[nb * bpb :], tail) and not lay.arenas[0][1].byte_view().any()


@KINDS
def test_a_repacked_arena_takes_an_orders_scattered_blocks_in_one_hook_call_per_chunk(monkeypatch, kind):
    """The hook is per block (`(n_blocks, bytes)` tensors), so an order's blocks in short runs go through it as one
    batch per `GATHER_CHUNK_BYTES` of stored rows, a long run as its own, and all land in order: the round trip is
    exact."""
    from kvproc.workers import copy_exec

    calls: list[tuple[RepackDirection, int]] = []

    def repack(group, direction, src, dst, arena):
        calls.append((direction, src.shape[0]))
        if direction is RepackDirection.SAVE:
            dst[:, :32] = src
            dst[:, 32:] = src[:, :8] ^ 0x5A  # a per-block trailer that depends on the block
        else:
            assert torch.equal(src[:, 32:], src[:, :8] ^ 0x5A)
            dst.copy_(src[:, :32])

    nb = 48
    lay = layout(nb=nb, stored=40)
    hl = HostLayout.plan(lay, 1 << 20)
    ex = CopyExecutor(lay, np.zeros(hl.total_bytes, dtype=np.uint8), hl, repack=repack, mover=mv(kind))
    k0 = lay.arenas[0][1]
    SAVE, LOAD = RepackDirection.SAVE, RepackDirection.LOAD

    def round_trip(ids: list[int], slots: list[int], dest: list[int]) -> None:
        snap = [block(k0, i).clone() for i in range(nb)]
        calls.clear()
        ex.save(SaveOrder("r", ids, slots))
        ex.load(LoadOrder("r", slots, dest))
        for src, dst in zip(ids, dest):
            assert torch.equal(block(k0, dst), snap[src])

    # a run of three (short) and scattered blocks, saved and loaded as one batch each (k0 only: k1 is not repacked)
    round_trip([7, 3, 30, 31, 32, 11, 0, 45], [9, 2, 40, 41, 42, 5, 17, 1], [1, 2, 3, 20, 21, 22, 46, 47])
    assert calls == [(SAVE, 8), (LOAD, 8)]
    # a run of four (both sides consecutive) is long: its own batch, the other two together; the same on the load
    round_trip([7, 20, 21, 22, 23, 0], [3, 10, 11, 12, 13, 30], [40, 41, 42, 43, 44, 45])
    if kind == "memmove":
        assert calls == [(SAVE, 4), (SAVE, 2), (LOAD, 4), (LOAD, 2)]
    else:  # the tensor executor gathers by id whatever the runs: one batch per direction
        assert calls == [(SAVE, 6), (LOAD, 6)]
    calls.clear()
    monkeypatch.setattr(copy_exec, "GATHER_CHUNK_BYTES", 3 * 40)  # three stored rows per batch
    ex.save(SaveOrder("r", [7, 3, 30, 31, 32, 11, 0, 45], [9, 2, 40, 41, 42, 5, 17, 1]))
    assert calls == [(SAVE, 3), (SAVE, 3), (SAVE, 2)]
