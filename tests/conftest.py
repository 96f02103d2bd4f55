"""Shared helpers of the `test_cluster_*` tests (no tests here): a byte-level model whose arenas live in the
scheduler's shared memory (`cs.allocator`), a ClusterStore context that checks nothing is left behind, and the
compute/churn helpers of the store contract tests.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools
import os
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Iterator

# One intra-op thread for torch (and numpy's BLAS) in this process and every process a test starts (inherited), set
# before torch is imported. The tiny models and copies here gain nothing from a second thread, and on a 2-core machine
# that is running anything else OpenMP's spinning workers made each forward ~5x slower in wall time and CPU alike
# (tests/engine/test_engine_prefix_cache.py -k dense: 28-30 s with two threads, 6 s with one, each under load ~5).
# Not where vLLM is installed: its CPU engine places its own OpenMP threads, and its suite is measured as it is.
if importlib.util.find_spec("vllm") is None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import psutil
import pytest
import torch

from kvproc import ArenaId, GroupKind, GroupSpec, KvArena, KvSpec, RepackDirection, RequestKv
from kvproc.ipc.segment import list_segments
from kvproc.runtime import manifest as mf
from kvproc.store.cluster import ClusterStore
from kvproc.store.kv_store import KvStore
from kvproc.store.types import SealCursor, StepFence, StoreConfig
from kvproc.tiers.kv_events import read_replay
from kvproc.tiers.mooncake_local import LocalMooncake, unavailable_reason

PAGE = 4
BLOCK_BYTES = 256
SLOT_BYTES = 128
STORED_EXTRA = 16  # a repacking model stores 16 more bytes per block

# Not a cluster's: shared helpers, and the Mooncake Store a test's `mooncake` fixture starts, restarts and stops.
_SHARED = ("multiprocessing.forkserver", "multiprocessing.resource_tracker", "mooncake_master", "mooncake_client")


class ShmBytesModel:
    """Paged group `kv` (two arenas) and optionally a bounded group `state` (two arenas), allocated through
    `allocator`. With `stored=True` the paged arenas declare a wider stored layout (repacked by `xor_repack`)."""

    def __init__(self, allocator: Callable[[str, int], torch.Tensor], num_blocks: int, *, bounded: bool = False,
                 slots: int = 6, stored: bool = False) -> None:
        groups = [GroupSpec("kv", GroupKind.PAGED)]
        if bounded:
            groups.append(GroupSpec("state", GroupKind.BOUNDED))
        self._spec = KvSpec(PAGE, tuple(groups), model_id="tests-bytes-model")
        sb = BLOCK_BYTES + STORED_EXTRA if stored else None
        self._arenas = [("kv", KvArena(f"kv{i}", allocator(f"kv{i}", num_blocks * BLOCK_BYTES), num_blocks,
                                       BLOCK_BYTES, BLOCK_BYTES, stored_bytes_per_block=sb,
                                       stored_layout="xor-trailer-v1" if sb else None)) for i in range(2)]
        if bounded:
            self._arenas += [("state", KvArena(f"st{i}", allocator(f"st{i}", slots * SLOT_BYTES), slots,
                                               SLOT_BYTES, SLOT_BYTES)) for i in range(2)]

    def spec(self) -> KvSpec:
        return self._spec

    def arenas(self, rank: int) -> list[tuple[str, KvArena]]:
        return list(self._arenas)

    def repack(self, group: str, direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor,
               arena: ArenaId) -> None:
        xor_repack(group, direction, src, dst, arena)

    def block(self, arena: int, bid: int) -> torch.Tensor:
        return self._arenas[arena][1].tensor[bid * BLOCK_BYTES : (bid + 1) * BLOCK_BYTES]

    def slot(self, arena: int, slot: int) -> torch.Tensor:
        return self._arenas[2 + arena][1].tensor[slot * SLOT_BYTES : (slot + 1) * SLOT_BYTES]

    def zero(self) -> None:
        for _, a in self._arenas:
            a.tensor.zero_()


def xor_repack(group: str, direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor, arena: ArenaId) -> None:
    """Stored row = payload XOR 0x5A, then 16 bytes of 0xEE; LOAD checks the trailer (a misplaced row fails)."""
    if direction is RepackDirection.SAVE:
        dst[:, :BLOCK_BYTES] = src ^ 0x5A
        dst[:, BLOCK_BYTES:] = 0xEE
    else:
        if not bool((src[:, BLOCK_BYTES:] == 0xEE).all()):
            raise ValueError("stored row has no trailer")
        dst.copy_(src[:, :BLOCK_BYTES] ^ 0x5A)


def xor_repack_failing_loads(group: str, direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor,
                              arena: ArenaId) -> None:
    """`xor_repack` whose LOAD always raises (a broken hook): saves work, every restore through it fails."""
    if direction is RepackDirection.LOAD:
        raise ZeroDivisionError(f"broken load hook for {arena.name}")
    xor_repack(group, direction, src, dst, arena)


def xor_repack_stale_copy(group: str, direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor,
                                       arena: ArenaId) -> None:
    """A stale copy of `xor_repack` (another key): the model's own hook and this one disagree."""
    dst[:, :BLOCK_BYTES] = src ^ 0x33
    dst[:, BLOCK_BYTES:] = 0xEE


def descendants() -> set[int]:
    procs = psutil.Process().children(recursive=True)
    out = set()
    for p in procs:
        try:
            if not any(s in " ".join(p.cmdline()) for s in _SHARED):
                out.add(p.pid)
        except psutil.NoSuchProcess:
            pass
    return out


@contextlib.contextmanager
def cluster_store(host_bytes: int = 1 << 20, *, num_blocks: int = 32, bounded: bool = False, stored: bool = False,
                  repack: str | None = None, config: StoreConfig = StoreConfig(resolve_deadline_s=3.0),
                  live_slots: int = 2, allocator: Callable[[str, int], torch.Tensor] | None = None,
                  step_fence: StepFence | None = None,
                  **start: Any) -> Iterator[tuple[ClusterStore, KvStore, ShmBytesModel]]:
    """A started ClusterStore with an attached ShmBytesModel (arenas from `allocator`, default the cluster's shared
    memory; `step_fence` given to `attach_model`); on exit: closed, and no process or segment left."""
    before = descendants()
    cs = ClusterStore.start(host_bytes, **start)
    name = cs.cluster.name
    try:
        model = ShmBytesModel(allocator or cs.allocator, num_blocks, bounded=bounded, stored=stored)
        store = cs.attach_model(model, live_slots=live_slots, config=config, repack=repack, step_fence=step_fence)
        yield cs, store, model
    finally:
        cs.close()
    deadline = time.monotonic() + 5
    while (left := descendants() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left behind: {left}"
    assert not list_segments(name), f"segments left behind: {list_segments(name)}"


def admit(store: KvStore, rid: str, tokens: list[int], max_out: int = 4,
          hit_blocks: int | None = None) -> tuple[RequestKv, Any]:
    """Resolve on rank 0, admit with the prefix found, restore it, schedule the rest of the prompt (not applied:
    requests admitted one after the other compute side by side); returns kv and the resolved prefix (its hold is
    consumed: `hit_blocks` asserts its size before)."""
    prefix = store.resolve_prefix_sync(0, rid, tokens)
    if hit_blocks is not None:
        assert prefix.hold.num_blocks == hit_blocks
    kv = RequestKv(store.pools[0], rid, tokens, max_out)
    assert kv.try_admit(prefix.hold.num_blocks)
    store.execute_copies(0, kv.match_and_add_prefix(prefix.hold))
    kv.schedule(len(tokens) - kv.num_computed)
    return kv, prefix


def compute(store: KvStore, model: ShmBytesModel, rid: str, tokens: list[int], max_out: int = 4,
            ) -> tuple[RequestKv, SealCursor, Any, dict[bytes, tuple[torch.Tensor, torch.Tensor]]]:
    """Admit with the resolved prefix, compute the rest, write random bytes into the new blocks; returns kv, cursor,
    prefix and {page hash: (bytes of arena 0, bytes of arena 1)} of every full page."""
    kv, prefix = admit(store, rid, tokens, max_out)
    start = kv.num_computed // PAGE
    for b in kv.block_ids[start:]:
        for a in range(2):
            model.block(a, b)[:] = torch.randint(0, 256, (BLOCK_BYTES,), dtype=torch.uint8)
    kv.apply()
    written = {kv.page_hashes[i]: (model.block(0, b).clone(), model.block(1, b).clone())
               for i, b in enumerate(kv.block_ids[: len(tokens) // PAGE])}
    return kv, SealCursor.after_prefix(start), prefix, written


def churn(store: KvStore) -> None:
    """Evict every unreferenced block of the device pool."""
    pool = store.pools[0]
    with pool.lock:
        ids = pool.paged.allocate(pool.paged.available)
        pool.paged.release(ids)


Written = dict[bytes, tuple[torch.Tensor, torch.Tensor]]


def saved(store: KvStore, model: ShmBytesModel, rid: str, toks: list[int]) -> Written:
    """Compute and retire a request, wait until its save landed and the tier committed it (a fire-and-forget message:
    until then the tier's slot table does not show the pages committed), churn the device pool; its page bytes."""
    kv, cur, _, written = compute(store, model, rid, toks)
    store.retire(0, kv, cur)
    store.flush_saves(0, 10)
    wait_for(lambda: store.stats()["tier"]["open_saves"] == 0, what="the save committed")
    churn(store)
    return written


def check_bytes(model: ShmBytesModel, prefix: Any, written: Written) -> None:
    """Every block of the prefix holds exactly the bytes saved under its hash."""
    for h, b in zip(prefix.hold.hashes, prefix.hold.block_ids):
        assert torch.equal(model.block(0, b), written[h][0]) and torch.equal(model.block(1, b), written[h][1])


def restores(store: KvStore, model: ShmBytesModel, rid: str, toks: list[int], written: Written) -> int:
    """Resolve `toks` after a churn, on zeroed arenas; checks every restored block's bytes; the pages restored."""
    churn(store)
    model.zero()
    prefix = store.resolve_prefix_sync(0, rid, toks)
    check_bytes(model, prefix, written)
    pages = int(prefix.hold.num_blocks)
    prefix.hold.release()
    return pages


def load_reasons(store: KvStore, rid: str) -> list[str]:
    """The reasons of the load outcomes recorded for a request, in order ("" for a plain load)."""
    return [o.reason for o in store.outcomes.for_request(rid, "load")]


def nothing_left(store: KvStore) -> None:
    """Loads settled, no block held or reserved, every lease back."""
    store.flush_loads(0, 5)
    assert store.stats()["rank0"]["active_blocks"] == 0
    wait_for(lambda: store.stats()["tier"]["open_leases"] == 0, what="every lease back")


def replay_kv_events(endpoint: str, start: int = 0) -> list[tuple[int, bytes]]:
    """Every (seq, payload) a KV-event publisher's replay endpoint still holds from `start` on (host tier or device
    pool: `kvproc.tiers.kv_events`); a frame that does not come within 10 s fails the test."""
    return list(read_replay(endpoint, start, timeout_ms=10_000))


def wait_for(cond: Callable[[], bool], timeout: float = 5.0, what: str = "condition") -> None:
    """Test-side wait for an observable state of another process (short sleeps; the code under test never polls)."""
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """SIGSTOP a child for the block (keep it under ~1 s: idle heartbeats declare a peer dead after 3 s)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


@contextlib.contextmanager
def kvproc_up(cluster: str, *extra: str) -> Iterator[tuple[str, int]]:
    """A standalone shared host tier (`kvproc up`, its own process tree) for this test: yields (runtime dir, the
    tier's pid); on exit `kvproc down`, and neither its segments nor its runtime dir may be left."""
    rd = f"/tmp/kvup-{cluster}{os.getpid()}"
    up = subprocess.Popen([sys.executable, "-m", "kvproc", "up", "--cluster", cluster, "--runtime-dir", rd,
                           "--host-mib", "8", *extra], stdout=subprocess.PIPE, text=True)
    try:
        assert "up; manifest" in (up.stdout.readline() if up.stdout else "")
        yield rd, next(p.pid for p in mf.read_manifest(rd).processes if p.role == "host_tier")
    finally:
        subprocess.run([sys.executable, "-m", "kvproc", "down", "--runtime-dir", rd, "--timeout", "10"], check=False,
                       capture_output=True)
        up.wait(10)
    assert not list_segments(cluster) and not os.path.exists(rd)


def _start_mooncake() -> Iterator[LocalMooncake]:
    why = unavailable_reason()
    if why:
        pytest.skip(why)
    with LocalMooncake.start(segment_mb=64) as mc:
        yield mc


@pytest.fixture
def own_mooncake() -> Iterator[LocalMooncake]:
    """A real Mooncake Store on loopback (a master and one 64 MiB storage node on free ports) for one test, which may
    kill and restart it; both processes killed at teardown. Skipped, with the reason, where the `remote` extra or
    libibverbs is missing."""
    yield from _start_mooncake()


@pytest.fixture(scope="module")
def _module_mooncake() -> Iterator[LocalMooncake]:
    yield from _start_mooncake()


class MooncakeNamespace:
    """One test's view of a module's Mooncake Store: its `url` carries a namespace of this test's own (`&ns=`: every
    key is prefixed with it, `kvproc/tiers/mooncake_client.py`), so no test sees a page another one wrote. No kill or
    restart here: a test that stops Mooncake takes `own_mooncake`."""

    def __init__(self, mc: LocalMooncake, ns: str) -> None:
        self._mc, self.ns = mc, ns

    @property
    def url(self) -> str:
        return f"{self._mc.url}&ns={self.ns}"


_mooncake_tests = itertools.count()


@pytest.fixture
def mooncake(_module_mooncake: LocalMooncake) -> MooncakeNamespace:
    """A real Mooncake Store on loopback, started once per test module (~1.2 s a start) and shared by its tests,
    each in a namespace of its own (an empty store as far as the test can tell)."""
    return MooncakeNamespace(_module_mooncake, f"t{os.getpid()}x{next(_mooncake_tests)}")


def remote_stats(store: KvStore) -> dict[str, int]:
    """The host tier's `remote.*` counters (its Mooncake tier), prefix dropped."""
    return {k[7:]: v for k, v in store.stats()["tier"].items() if k.startswith("remote.")}


def written_behind(store: KvStore, pages: int, timeout: float = 10.0) -> dict[str, int]:
    """Wait until the host tier's write-behind is idle with at least `pages` keys written (or found present)."""
    def done() -> bool:
        st = remote_stats(store)
        return st.get("queued_pages", 1) == 0 and st.get("writes_ok", 0) + st.get("writes_present", 0) >= pages
    wait_for(done, timeout, f"{pages} pages written behind")
    return remote_stats(store)
