"""Repack is declared, not guessed (issue 18): an arena's `stored_layout` makes every save and load of its blocks go
through the model's hook whatever the sizes, the hook is told which arena, and the fingerprints name the layouts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvproc import ArenaId, GroupKind, GroupSpec, KvArena, KvContractError, KvSpec, RepackDirection, validate_layout
from kvproc.contract import check_repack_hook
from kvproc.core.hashing import HashAlgorithm
from kvproc.ipc.orders import LoadOrder, SaveOrder
from kvproc.store.handoff import fingerprint as handoff_fingerprint
from kvproc.tiers.layout import HostLayout
from kvproc.workers.copy_exec import CopyExecutor
from kvproc.workers.movers import mover_for

ROW = 32


def _layout(stored_layout: str | None, *, seed: int = 0) -> object:
    """Two paged arenas of one group (e.g. two layers): `k0`, `k1`. Only `k0` declares `stored_layout`."""
    g = torch.Generator().manual_seed(seed)
    spec = KvSpec(4, (GroupSpec("kv", GroupKind.PAGED),), model_id="tests/stored-layout")
    return validate_layout(spec, [
        ("kv", KvArena("k0", torch.randint(0, 255, (8 * ROW,), dtype=torch.uint8, generator=g), 8, ROW, ROW,
                       stored_layout=stored_layout)),
        ("kv", KvArena("k1", torch.randint(0, 255, (8 * ROW,), dtype=torch.uint8, generator=g), 8, ROW, ROW)),
    ])


def _rows(arena: KvArena) -> torch.Tensor:
    return arena.byte_view().view(arena.num_blocks, ROW)


def _reverse(calls: list[tuple[str, RepackDirection, ArenaId]]):  # type: ignore[no-untyped-def]
    """A same-size layout with another order (bytes of a row reversed: think K kept transposed for a kernel)."""
    def repack(group: str, direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor, arena: ArenaId) -> None:
        calls.append((group, direction, arena))
        dst.copy_(src.flip(1))
    return repack


@pytest.mark.parametrize("kind", ["memmove", "torch"])
@pytest.mark.parametrize("declared", [True, False], ids=["declared", "control-undeclared"])
def test_a_same_size_stored_layout_is_repacked_on_save_and_load(declared: bool, kind: str) -> None:
    lay = _layout("reversed-v1" if declared else None)
    hl = HostLayout.plan(lay, 1 << 16)  # type: ignore[arg-type]
    host = np.zeros(hl.total_bytes, dtype=np.uint8)
    calls: list[tuple[str, RepackDirection, ArenaId]] = []
    ex = CopyExecutor(lay, host, hl, repack=_reverse(calls), mover=mover_for("cpu", kind=kind))  # type: ignore[arg-type]
    k0 = lay.arenas[0][1]  # type: ignore[attr-defined]
    want = _rows(k0)[[1, 4, 6]].clone()
    ex.save(SaveOrder("r", [1, 4, 6], [0, 1, 2]))
    region = hl.region("k0")
    stored = torch.from_numpy(host[region.offset: region.offset + 3 * ROW].reshape(3, ROW).copy())
    if declared:  # the tier holds the stored layout, and only the declaring arena went through the hook
        assert torch.equal(stored, want.flip(1))
        assert calls == [("kv", RepackDirection.SAVE, ArenaId("k0", 0))]
    else:  # no declaration: bytes as executed, the hook never runs (the old size-inferred rule, now explicit)
        assert torch.equal(stored, want) and calls == []
    _rows(k0)[[1, 4, 6]] = 0
    ex.load(LoadOrder("r", [0, 1, 2], [1, 4, 6]))
    assert torch.equal(_rows(k0)[[1, 4, 6]], want)  # exact both ways
    if declared:
        assert calls[-1] == ("kv", RepackDirection.LOAD, ArenaId("k0", 0))


def test_the_hook_is_told_each_arenas_name_and_its_index_in_the_group() -> None:
    spec = KvSpec(4, (GroupSpec("kv", GroupKind.PAGED),), model_id="tests/stored-layout")
    lay = validate_layout(spec, [
        ("kv", KvArena(f"L{i}", torch.zeros(4 * ROW, dtype=torch.uint8), 4, ROW, ROW, stored_layout="x-v1"))
        for i in range(3)])
    assert [lay.arena_id(f"L{i}") for i in range(3)] == [ArenaId(f"L{i}", i) for i in range(3)]
    hl = HostLayout.plan(lay, 1 << 16)
    calls: list[tuple[str, RepackDirection, ArenaId]] = []
    CopyExecutor(lay, np.zeros(hl.total_bytes, dtype=np.uint8), hl, repack=_reverse(calls)).save(
        SaveOrder("r", [0, 2], [0, 1]))
    assert sorted(c[2] for c in calls) == [ArenaId(f"L{i}", i) for i in range(3)]


def test_engines_that_store_other_layouts_have_other_fingerprints() -> None:
    mine, theirs, plain = _layout("reversed-v1"), _layout("transposed-k-v2"), _layout(None)
    prints = {handoff_fingerprint("M", lay, HashAlgorithm.BLAKE2B_128) for lay in (mine, theirs, plain)}  # type: ignore[arg-type]
    assert len(prints) == 3  # same sizes everywhere: only the layout names tell them apart
    assert "k0:32:reversed-v1" in handoff_fingerprint("M", mine, HashAlgorithm.BLAKE2B_128)  # type: ignore[arg-type]
    assert "k1:32:-" in handoff_fingerprint("M", mine, HashAlgorithm.BLAKE2B_128)  # type: ignore[arg-type]


def test_a_changed_size_without_a_declared_layout_is_refused_naming_the_fix() -> None:
    with pytest.raises(KvContractError, match="stored_layout='my-layout-v1'"):
        KvArena("k0", torch.zeros(8 * ROW, dtype=torch.uint8), 8, ROW, ROW, stored_bytes_per_block=ROW + 8)
    ok = KvArena("k0", torch.zeros(8 * ROW, dtype=torch.uint8), 8, ROW, ROW, stored_bytes_per_block=ROW + 8,
                 stored_layout="wide-v1")
    assert ok.repacked and ok.stored_bytes == ROW + 8


@pytest.mark.parametrize("bad", ["", "has space", "a,b", "x" * 65, 3])
def test_a_layout_name_that_cannot_be_told_apart_in_a_fingerprint_is_refused(bad: object) -> None:
    with pytest.raises(KvContractError, match="stored_layout must be a layout name"):
        KvArena("k0", torch.zeros(8 * ROW, dtype=torch.uint8), 8, ROW, ROW, stored_layout=bad)  # type: ignore[arg-type]


def test_a_hook_without_the_arena_parameter_is_refused_with_the_fix() -> None:
    def old(group, direction, src, dst):  # type: ignore[no-untyped-def]
        dst.copy_(src)

    with pytest.raises(KvContractError, match=r"must take \(group, direction, src, dst, arena\)"):
        check_repack_hook(old, "OldModel")
    assert check_repack_hook(_reverse([]), "NewModel") is not None


def test_a_failing_hook_is_counted_by_arena_and_logged_once_per_cause_with_its_traceback() -> None:
    import structlog

    from kvproc.workers.copy_exec import RepackError

    def broken(group: str, direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor, arena: ArenaId) -> None:
        if direction is RepackDirection.LOAD:
            raise KeyError("no such tile")
        dst.copy_(src)

    lay = _layout("reversed-v1")
    hl = HostLayout.plan(lay, 1 << 16)  # type: ignore[arg-type]
    ex = CopyExecutor(lay, np.zeros(hl.total_bytes, dtype=np.uint8), hl, repack=broken)  # type: ignore[arg-type]
    ex.save(SaveOrder("r", [1], [0]))
    with structlog.testing.capture_logs() as logs:
        for _ in range(3):
            with pytest.raises(RepackError, match="load of arena 'k0'") as err:
                ex.load(LoadOrder("r", [0], [1]))
    assert err.value.arena == ArenaId("k0", 0) and "KeyError: 'no such tile'" in err.value.trace
    assert ex.repack_failures.by_arena == {"k0": 3}
    errors = [e for e in logs if e["event"] == "repack_hook_failed"]
    assert len(errors) == 1 and errors[0]["log_level"] == "error" and "broken" in errors[0]["traceback"]
