"""Properties of `kvproc.check_model` over generated model geometries (hypothesis): a correct stored layout of any
geometry passes every proof; a LOAD that gets any one byte wrong is named at exactly that byte, in the layout proof
(offset in the block) and in the host round trip (offset in the arena, modulo the block stride)."""

from __future__ import annotations

import dataclasses

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvproc import ArenaId, GroupKind, GroupSpec, KvArena, KvSpec, RepackDirection, check_model
from tests.hypothesis_budget import examples


@dataclasses.dataclass
class RotatedModel:
    """Paged arenas stored rotated by `shift` bytes per row (a bijection); `bad_byte` >= 0 breaks LOAD there."""

    page: int
    row_bytes: int
    layers: int
    shift: int
    bad_byte: int = -1
    name: str = "rotated"

    def __post_init__(self) -> None:
        size = self.page * self.row_bytes
        self._arenas = [("kv", KvArena(f"L{i}", torch.zeros(8 * size, dtype=torch.uint8), 8, size, size,
                                       stored_layout="rotated-v1")) for i in range(self.layers)]

    def spec(self) -> KvSpec:
        return KvSpec(self.page, (GroupSpec("kv", GroupKind.PAGED),), model_id="tests/rotated@1")

    def arenas(self, rank: int) -> list[tuple[str, KvArena]]:
        return self._arenas

    def repack(self, group: str, direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor,
               arena: ArenaId) -> None:
        save = direction is RepackDirection.SAVE
        dst.copy_(torch.roll(src, self.shift if save else -self.shift, dims=1))
        if not save and self.bad_byte >= 0:
            dst[:, self.bad_byte] ^= 0x80


geometry = st.tuples(st.sampled_from([1, 2, 4, 8]), st.integers(1, 24), st.integers(1, 3))


@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(geometry, st.data())
def test_a_correct_layout_passes_and_one_wrong_load_byte_is_named_where_it_is(g: tuple[int, int, int],
                                                                             data: st.DataObject) -> None:
    page, row_bytes, layers = g
    block = page * row_bytes
    shift = data.draw(st.integers(1, max(1, block - 1))) if block > 1 else 0
    good = check_model(RotatedModel(page, row_bytes, layers, shift))
    if block > 1:  # a rotation of a one-byte row is the identity: "not applied", rightly
        assert good.ok, good.text()
    bad = data.draw(st.integers(0, block - 1))
    report = check_model(RotatedModel(page, row_bytes, layers, shift, bad_byte=bad))
    assert not report.ok
    layout = [(f.arena, f.offset) for f in report.failures if f.check == "stored layout"]
    if block > 1:
        assert layout == [(f"L{i}", bad) for i in range(layers)], report.text()
    trips = [f for f in report.failures if f.check == "host round trip"]
    assert trips and all(f.offset is not None and f.offset % block == bad for f in trips), report.text()
