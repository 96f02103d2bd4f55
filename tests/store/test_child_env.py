"""What the contract page says of the copy workers' environment: they are forked from a server started at the first
launch of the process, so a variable set after that never reaches them (a hook must not count on one)."""

from __future__ import annotations

import os

import pytest
import torch

from kvproc.contract import ArenaId, RepackDirection
from kvproc.store.cluster import ClusterStore
from tests.conftest import churn, cluster_store, compute, xor_repack

pytestmark = pytest.mark.timeout(90)
VAR = "KVPROC_TEST_LATE_ENV"


def env_repack(group: str, direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor, arena: ArenaId) -> None:
    """`xor_repack`, whose LOAD raises where `VAR` is set: a restore through it tells whether the worker saw it."""
    if RepackDirection(direction) is RepackDirection.LOAD and VAR in os.environ:
        raise RuntimeError(f"{VAR} is set in this process")
    xor_repack(group, direction, src, dst, arena)


def test_a_copy_worker_does_not_see_environment_set_after_the_first_launch() -> None:
    assert VAR not in os.environ
    ClusterStore.start(0).close()  # the first launch of this process: the server the workers fork from starts
    os.environ[VAR] = "set-late"
    try:
        with pytest.raises(RuntimeError, match="is set"):  # the control: where the variable is, the hook refuses
            env_repack("kv", RepackDirection.LOAD, torch.zeros(1, 4), torch.zeros(1, 4), ArenaId("a", 0))
        with cluster_store(stored=True, repack="tests.store.test_child_env:env_repack") as (_, store, model):
            toks = list(range(1, 10))
            kv, cur, _, _ = compute(store, model, "a", toks)
            store.retire(0, kv, cur)
            store.flush_saves(0, 10)
            churn(store)
            pre = store.resolve_prefix_sync(0, "b", toks)
            # the worker's LOAD hook ran without the variable: the load succeeded
            assert pre.host_tokens == 8, store.stats()["store"]
            pre.hold.release()
    finally:
        del os.environ[VAR]
