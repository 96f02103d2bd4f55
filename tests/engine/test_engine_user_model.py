"""The reference engine serves a user's own model through its documented protocol (`kvproc.EngineModel`, and
`kvproc.RankedEngineModel` for N ranks; issue 40 items 1 and 11), not only the built-in `RankedModel`."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest
import torch

from kvproc import (
    ArenaId,
    EngineModel,
    KvArena,
    KvSpec,
    RankedEngineModel,
    RankStep,
    RepackDirection,
    SeqBatchItem,
    build_local_store,
)
from kvproc.engine.engine import Engine
from kvproc.engine.models import build_model
from kvproc.engine.request import Request

pytestmark = pytest.mark.timeout(300)


class UserTpModel:
    """A user's TP model written against the protocol only (no kvproc base class): rank r computes over its own
    arenas (here a replica of the tiny dense model, built by the user's own code)."""

    def __init__(self, tp: int) -> None:
        self._ranks = [build_model("dense", num_blocks=16, num_slots=2, seed=5) for _ in range(tp)]
        self.name, self.vocab_size, self.eos_token_id = "user-tp", self._ranks[0].vocab_size, -1

    @property
    def ranks(self) -> int:
        return len(self._ranks)

    def rank_model(self, rank: int) -> RankStep:
        return self._ranks[rank]

    def spec(self) -> KvSpec:
        return self._ranks[0].spec()

    def arenas(self, rank: int) -> list[tuple[str, KvArena]]:
        return self._ranks[rank].arenas(0)

    def repack(self, group: str, direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor,
               arena: ArenaId) -> None:
        dst.copy_(src)


def _tokens(model: EngineModel | RankedEngineModel, ranks: int) -> list[list[int]]:
    """Two turns of one conversation; between them the device cache is dropped so the second turn's prefix comes
    back from each rank's host tier."""
    store = build_local_store(model, live_slots=2, host_bytes=8 << 20, ranks=ranks)
    try:
        eng = Engine(model, store, ranks=ranks, max_batch=2, chunk_tokens=48, checkpoint_every_pages=1)
        rng = np.random.default_rng(3)
        prompt = rng.integers(2, model.vocab_size, 40)
        out = []
        for turn in range(2):
            req = Request.make(f"t{turn}", prompt, 6)
            eng.run([req])
            assert req.failed is None, req.failed
            out.append(req.output)
            prompt = np.concatenate([req.prompt, req.output, rng.integers(2, model.vocab_size, 8)])
            for r in range(ranks):
                store.flush_saves(r, 30)
                store.drop_device_cache(r)
        stats = store.stats()
        assert all(stats[f"rank{r}"]["committed_loaded_blocks"] > 0 for r in range(ranks)), stats  # from the host
        return out
    finally:
        store.close()


def test_the_engine_runs_a_users_ranked_model_through_the_protocol() -> None:
    user = UserTpModel(2)
    assert isinstance(user, RankedEngineModel)
    one = build_model("dense", num_blocks=16, num_slots=2, seed=5)
    assert isinstance(one, EngineModel)
    assert _tokens(user, 2) == _tokens(one, 1)


def test_a_model_missing_an_engine_member_is_refused_naming_it() -> None:
    class NoForward:
        def __init__(self) -> None:
            self._m = build_model("dense", num_blocks=4, num_slots=1)
            self.name, self.vocab_size, self.eos_token_id = "x", 10, 0

        def spec(self) -> KvSpec:
            return self._m.spec()

        def arenas(self, rank: int) -> Sequence[tuple[str, KvArena]]:
            return self._m.arenas(rank)

        def repack(self, *a: object) -> None: ...

        def reset_slot(self, group: str, slot: int) -> None: ...

    model = NoForward()
    store = build_local_store(model, live_slots=1)
    try:
        with pytest.raises(TypeError, match=r"lacks \['forward'\].*kvproc.EngineModel"):
            Engine(model, store)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"ranks=1, but UserTpModel has 2 rank\(s\)"):
            Engine(UserTpModel(2), store, ranks=1)
    finally:
        store.close()
    assert SeqBatchItem.__module__ == "kvproc.engine.models.base"  # exported: what a user's forward is given
