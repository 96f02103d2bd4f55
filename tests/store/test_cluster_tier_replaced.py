"""A shared tier replaced under a running engine (issue 39, item 4): `kvproc up` SIGKILLed and started again on the
same runtime dir. The engine's store re-attaches to the new tier (another `Configured.incarnation`) with nothing of
the old one trusted, and serves host hits again, bit for bit, without a restart.

Control: the code before this test left a replaced tier alone (`shared_tier_replaced`: the store then served without
a tier until the engine restarted): the wait for the re-attach below times out there.
"""

from __future__ import annotations

import contextlib

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from kvproc.ipc.errors import RemoteError
from kvproc.ipc.orders import LoadOrder
from kvproc.ipc.segment import list_segments
from kvproc.runtime import manifest as mf
from kvproc.store.cluster import ClusterStore
from tests.conftest import wait_for
from tests.store.conftest import SharedMemoryModel, compute

pytestmark = pytest.mark.timeout(180)

CLUSTER = f"rept{os.getpid()}"


def _up(rd: str) -> subprocess.Popen[str]:
    up = subprocess.Popen([sys.executable, "-m", "kvproc", "up", "--cluster", CLUSTER, "--runtime-dir", rd,
                           "--host-mib", "8"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert up.stdout is not None and "up; manifest" in up.stdout.readline()
    return up


def _tier_pid(rd: str) -> int:
    return next(p.pid for p in mf.read_manifest(rd).processes if p.role == "host_tier")


def _maps(pid: int) -> str:
    return Path(f"/proc/{pid}/maps").read_text()


def _save_and_drop(store, model, rid: str, toks: list[int]):  # type: ignore[no-untyped-def]
    """Compute `toks`, save them to the tier, and evict them from the device cache: the next resolve is the tier's."""
    kv, cur, _, written = compute(store, model, rid, toks)
    store.execute_copies(0, kv.seal_by_copy())  # the bounded checkpoint at the last page
    store.retire(0, kv, cur)
    store.flush_saves(0, 20)
    assert store.outcomes.for_request(rid, "save")[-1].state == "ok"
    store.drop_device_cache(0)
    return written


def _host_hit(store, model, rid: str, toks: list[int], written) -> int:  # type: ignore[no-untyped-def]
    store.drop_device_cache(0)  # what an earlier hit loaded is not the device's to answer
    pre = store.resolve_prefix_sync(0, rid, toks + [1])
    try:
        assert pre.device_tokens == 0
        for i, b in enumerate(pre.hold.block_ids):
            want = written[pre.hold.hashes[i]]
            assert torch.equal(model.block(0, b), want[0]) and torch.equal(model.block(1, b), want[1])
        return int(pre.host_tokens)
    finally:
        pre.hold.release()


def test_an_engine_reattaches_to_a_kvproc_up_restarted_on_its_runtime_dir(tmp_path: Path) -> None:
    rd = str(tmp_path / "rt")
    up = _up(rd)
    try:
        with ClusterStore.start(1 << 20, tier_runtime_dir=rd) as cs:
            model = SharedMemoryModel(cs.allocator)
            store = cs.attach_model(model, live_slots=2)
            tier = store.tier
            assert tier is not None
            first = list(range(1, 17))
            written = _save_and_drop(store, model, "a", first)
            assert _host_hit(store, model, "a-hit", first, written) == 16  # the old tier serves it
            old_segment, old_pid = cs.host_segment, _tier_pid(rd)
            worker = cs.cluster.pid("copy_worker")
            assert old_segment in _maps(worker)

            os.kill(up.pid, signal.SIGKILL)  # the operator's tier goes, its children with it (parent_death.py)
            up.wait(30)
            with contextlib.suppress(psutil.NoSuchProcess):  # it may be gone between any two calls
                psutil.wait_procs([psutil.Process(old_pid)], timeout=30)
            wait_for(lambda: not os.path.exists(rd), timeout=60, what="the janitor removed the old runtime dir")
            up = _up(rd)  # the operator starts it again, on the same runtime dir
            new_pid = _tier_pid(rd)

            t0 = time.monotonic()
            # (Until the old client is declared dead -- 3 s of heartbeats -- the store still believes in the old
            # tier: its calls time out and it degrades meanwhile.)
            wait_for(lambda: getattr(cs, "tier_reattaches", 0) == 1 and tier.available, timeout=60,
                     what="the store re-attached to the new tier")
            print(f"re-attached {time.monotonic() - t0:.2f} s after the new tier was up")
            assert cs.host_segment != old_segment
            assert cs.host_segment.startswith(f"kvproc.{CLUSTER}.host_tier.{new_pid}.")
            assert tier.epoch == 1 and cs.copiers[0].attach_msg.host_epoch == 1
            # Nothing of the old tier is mapped any more: not the worker's arena, nothing in this process.
            assert old_segment not in _maps(os.getpid())
            wait_for(lambda: old_segment not in _maps(worker), timeout=30, what="the worker unmapped the old segment")
            assert cs.host_segment in _maps(worker)

            # The new tier holds nothing yet: the old one's pages are not believed in (a miss, computed again) ...
            assert _host_hit(store, model, "a-miss", first, written) == 0
            # ... and what is saved now comes back from it, bit for bit.
            second = list(range(101, 117))
            written2 = _save_and_drop(store, model, "b", second)
            assert _host_hit(store, model, "b-hit", second, written2) == 16
            written = _save_and_drop(store, model, "a2", first)
            assert _host_hit(store, model, "a2-hit", first, written) == 16
            assert store.stats()["tier"]["saves_committed"] >= 2
            # A hit the old tier gave (epoch 0), loaded only now, would read the new tier's segment at the old
            # one's slots: the worker refuses it whole.
            stale = LoadOrder("stale", [0], [0], [], host_epoch=0)
            with pytest.raises(RemoteError) as err:
                store.submit(cs.copiers[0].load(stale)).result(30)
            assert err.value.code == "stale_host_tier"
    finally:
        subprocess.run([sys.executable, "-m", "kvproc", "down", "--runtime-dir", rd, "--timeout", "10"],
                       check=False, capture_output=True)
        up.wait(10)
    wait_for(lambda: not list_segments(CLUSTER), timeout=30, what="no segment of the tiers left")
    assert not os.path.exists(rd)
