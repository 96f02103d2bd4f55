"""The reference engine on two nodes sharing one Mooncake Store: a conversation's first turn runs on node A, its next
turn on node B, whose host tier never saw it. B's prefix comes from Mooncake (through its own host tier), and the
tokens and logits equal the same turns run without any cache. `hybrid` checkpoints bounded state too: its artifacts
travel with their pages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvproc.engine.engine import Engine
from kvproc.engine.request import Request
from kvproc.engine.topology import PoolSizes, Topology, make_store
from kvproc.store.types import StoreConfig
from kvproc.tiers.mooncake_local import LocalMooncake
from tests.conftest import remote_stats, written_behind

pytestmark = pytest.mark.timeout(120)

FIRST, NEW, OUT = 64, 32, 8
TOL = {"rtol": 1e-4, "atol": 1e-4}
SIZES = PoolSizes(device_blocks=64, live_slots=2, staging_slots=8, host_bytes=8 << 20)


def _node(model: str, remote: str | None) -> Topology:
    if remote is None:
        return make_store("no_cache", model, SIZES, seed=3)
    return make_store("kvproc", model, SIZES, seed=3, processes=True, remote=remote,
                      config=StoreConfig(cacheable_pin_fraction=1.0))


def _turn(t: Topology, rid: str, prompt: np.ndarray) -> Request:
    eng = Engine(t.model, t.store, max_batch=1, chunk_tokens=48, checkpoint_every_pages=2,
                 prefix_cache=t.prefix_cache)
    req = Request.make(rid, prompt, OUT, keep_logits=True)
    eng.run([req])
    assert req.failed is None, req.failed
    t.store.flush_saves(0)
    return req


@pytest.mark.parametrize("model", ["dense", "hybrid"])
def test_a_conversation_continued_on_another_node_is_served_from_mooncake(mooncake: LocalMooncake,
                                                                          model: str) -> None:
    rng = np.random.default_rng(11)
    first = rng.integers(2, 200, FIRST)
    new = rng.integers(2, 200, NEW)
    with _node(model, None) as t:
        r0 = _turn(t, "t0", first)
        ref = _turn(t, "t1", np.concatenate([first, r0.output, new]))
    with _node(model, mooncake.url) as a, _node(model, mooncake.url) as b:
        a0 = _turn(a, "t0", first)
        assert a0.output == r0.output
        written_behind(a.store, FIRST // 16)
        got = _turn(b, "t1", np.concatenate([first, a0.output, new]))
        assert got.host_hit_tokens > 0 and got.device_hit_tokens == 0  # B's own tiers had nothing
        assert remote_stats(b.store)["pulled_pages"] > 0
    assert got.output == ref.output
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(ref.logits), **TOL)
