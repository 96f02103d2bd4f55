"""`store.drop_device_cache(rank)` waits for the rank's saves in flight (issue 40 item 2): a save pins the blocks it
reads, so a drop that did not wait left them on the device (1 run in 4 got 64 device + 64 host tokens). A save
made slow on purpose (its repack hook sleeps) shows it every time."""

from __future__ import annotations

import time

import pytest
import torch

from kvproc import ArenaId, RepackDirection
from tests.conftest import cluster_store, compute, xor_repack

pytestmark = pytest.mark.timeout(120)
SAVE_DELAY_S = 1.0


def slow_save_repack(group: str, direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor,
                     arena: ArenaId) -> None:
    """`xor_repack` whose SAVE takes a second (a copy worker busy with a large save)."""
    if RepackDirection(direction) is RepackDirection.SAVE:
        time.sleep(SAVE_DELAY_S)
    xor_repack(group, direction, src, dst, arena)


def _drop_right_after_retire(drop: bool) -> tuple[int, int]:
    with cluster_store(stored=True, repack="tests.store.test_drop_device_cache_saves:slow_save_repack") \
            as (_, store, model):
        toks = list(range(1, 18))
        kv, cur, _, _ = compute(store, model, "a", toks)
        store.retire(0, kv, cur)  # the save starts; its hook sleeps
        if drop:
            store.drop_device_cache(0)
        else:  # the control: what the old drop did (evict at once, saves still in flight)
            store.pools[0].evict_cached()
            store.flush_saves(0, 30)
        pre = store.resolve_prefix_sync(0, "b", toks)
        pre.hold.release()
        return pre.device_tokens, pre.host_tokens


def test_a_drop_waits_for_the_saves_in_flight_so_the_prefix_comes_from_the_host() -> None:
    assert _drop_right_after_retire(True) == (0, 16)
    device, host = _drop_right_after_retire(False)  # the control: the save's pinned blocks survive the drop
    assert device == 16 and host == 0, (device, host)
