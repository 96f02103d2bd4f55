"""`ClusterStore`: the multi-process store an engine uses (host tier and copy workers in their own processes).

    with ClusterStore.start(host_bytes=1 << 30) as cs:
        model = build_model("dense", ..., allocator=cs.allocator)   # arenas live in segments the scheduler owns
        store = cs.attach_model(model, live_slots=8)                 # a KvStore with RemoteTier + RemoteCopier
        ...

Processes: `host_tier[r]` and `copy_worker[r]` for each rank (the tiers only when `host_bytes > 0`: `host_bytes` each,
a rank's shard in its own tier), launched and supervised by `kvproc.runtime.launch`. Ownership: the scheduler owns
the arena segments (`cs.allocator`), each host tier owns its host segment, the copy workers own nothing (they attach
both). `close()` closes the store (flushing saves and abandoned loads), shuts the cluster down (message, SIGTERM,
SIGKILL against one deadline) and unlinks the arena segments: nothing is left in /dev/shm and no process is left.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import threading
import time
import weakref
from typing import Any, Mapping, Sequence

import numpy as np
import posix_ipc
import structlog
import torch

from kvproc.contract import (
    ArenaLayout,
    KvArena,
    KvContractError,
    KvModel,
    check_hooks_agree,
    check_repack_hook,
    require_model_id,
    validate_layout,
)
from kvproc.core.hashing import HashAlgorithm
from kvproc.ipc import messages as m
from kvproc.ipc.client import RpcClient
from kvproc.ipc.errors import RemoteError
from kvproc.ipc.segment import Segment, SegmentBusyError
from kvproc.runtime import manifest as mf
from kvproc.runtime.config import RoleConfig
from kvproc.runtime.event_interval import DEFAULT_INTERVAL_S, check_interval
from kvproc.runtime.launcher import Cluster, launch
from kvproc.store.device_events import DevicePublishers
from kvproc.store.handoff import DEFAULT_HASH, FingerprintMismatch, model_label
from kvproc.store.handoff import fingerprint as handoff_fingerprint
from kvproc.store.kv_store import KvStore
from kvproc.store.types import StepFence, StoreConfig
from kvproc.tiers.host import layout_from_wire, layout_to_wire
from kvproc.tiers.layout import HostLayout
from kvproc.tiers.load_fence import LOAD_FENCE_WORDS, LoadFences
from kvproc.tiers.remote import RemoteCopier, RemoteTier
from kvproc.tiers.save_fence import derived_save_ttl
from kvproc.workers.worker import import_callable

_names = itertools.count()
log = structlog.get_logger("kvproc.store.cluster")
ARENA_ROLE = "arena"  # the role part of the scheduler's segment names: kvproc.<cluster>.arena.<pid>.<n>


def _unlink_all(names: list[str]) -> None:
    # weakref.finalize backstop: holds names only, never the ClusterStore.
    for name in names:
        try:
            posix_ipc.unlink_shared_memory("/" + name)
        except posix_ipc.ExistentialError:
            pass


def _call_if_alive(method: "weakref.WeakMethod[Any]", *args: Any) -> None:
    fn = method()
    if fn is not None:
        fn(*args)


def fingerprint(model: KvModel, layout: ArenaLayout, algorithm: HashAlgorithm = DEFAULT_HASH) -> str:
    """The tier's fingerprint of `model`: the one definition (`kvproc.fingerprint`, the hand-off's), with the model
    named by `model_label(model)`; two engines may share a host tier only if theirs are equal."""
    return handoff_fingerprint(model_label(model), layout, algorithm)


def _shared_tier_endpoint(runtime_dir: str, rank: int) -> tuple[str, str]:
    """Rank `rank`'s endpoint and the auth token of the shared cluster at `runtime_dir`, as its manifest says now (a
    `kvproc up` restarted on the dir writes new ones); raises while there is none (no manifest yet, tier not up)."""
    manifest = mf.read_manifest(mf.find_runtime_dir(runtime_dir=runtime_dir))
    tier = next((p for p in manifest.processes if p.role == "host_tier" and p.rank == rank and p.state == "up"), None)
    if tier is None:
        raise RuntimeError(f"no running host tier[{rank}] in the cluster at {runtime_dir}")
    return tier.endpoint, mf.read_token(manifest.runtime_dir)


def _connect_external_tiers(runtime_dir: str, ranks: int, timeout: float) -> tuple[list[RpcClient], str, str]:
    """Rank r's client to `host_tier[r]` of a shared cluster (`kvproc up --ranks N`), for the ranks r < `ranks` it
    runs from 0 on; its token; and, where it runs fewer than `ranks`, why a PER_RANK model cannot attach (a
    REPLICATED model needs rank 0's only: `ClusterStore.attach_model` decides, knowing the model)."""
    manifest = mf.read_manifest(mf.find_runtime_dir(runtime_dir=runtime_dir))
    tiers = {p.rank: p for p in manifest.processes if p.role == "host_tier" and p.state == "up"}
    if 0 not in tiers:
        raise RuntimeError(f"no running host tier[0] in the cluster at {runtime_dir} (start one with `kvproc up`)")
    present = next(r for r in range(ranks + 1) if r == ranks or r not in tiers)
    short = "" if present == ranks else (
        f"the shared cluster at {runtime_dir} runs host tiers for ranks {sorted(tiers)}; this store has {ranks}"
        f" rank(s) and a PER_RANK model needs one per rank (a tier's keys carry no rank): start it with "
        f"`kvproc up --ranks {ranks}` (a REPLICATED model is stored once, in host tier[0]: `kvproc up` serves it)")
    clients: list[RpcClient] = []
    token = mf.read_token(manifest.runtime_dir)
    try:
        for r in range(present):
            clients.append(RpcClient(tiers[r].endpoint, token=token, name="engine",
                                     peer=f"shared host tier[{r}] ({manifest.cluster})"))
            clients[-1].connect(timeout)
    except BaseException:
        for c in clients:
            c.close()
        raise
    return clients, token, short


def _pinned(roles: list[RoleConfig], cpus: Mapping[str, Sequence[int]]) -> list[RoleConfig]:
    """`roles` with their CPU sets from `cpus` (keys: a role for all its ranks, or "role[rank]" for one)."""
    names = {c.role for c in roles} | {f"{c.role}[{c.rank}]" for c in roles}
    unknown = sorted(set(cpus) - names)
    if unknown:
        raise ValueError(f"cpus names {unknown}: this cluster has {sorted(names)}")
    out = []
    for c in roles:
        want = cpus.get(f"{c.role}[{c.rank}]", cpus.get(c.role))
        out.append(dataclasses.replace(c, cpus=tuple(want)) if want is not None else c)
    return out


def _cuda_ref(a: KvArena) -> tuple[int, m.CudaIpcRef]:
    """A GPU arena's (offset in its shared storage, CUDA IPC handle), exported once at attach (`kvproc/ipc/
    cuda_ipc.py`); the model keeps the tensor alive while the workers have it open. NEVER RUN."""
    from kvproc.ipc.cuda_ipc import export_arena

    h = export_arena(a.name, a.byte_view(), a.num_blocks, a.bytes_per_block, a.block_stride)
    return h.offset, h.ipc


class ClusterStore:
    def __init__(self, cluster: Cluster, host_bytes: int, ranks: int, *, copy_timeout_s: float,
                 shutdown_deadline_s: float) -> None:
        self.cluster = cluster
        self.host_bytes = host_bytes
        self.ranks = ranks
        self.copy_timeout_s = copy_timeout_s
        self.shutdown_deadline_s = shutdown_deadline_s
        self.store: KvStore | None = None
        self.device_kv_events = False  # publish device-pool events from attach_model on (`start(device_kv_events=)`)
        self.copy_mover = ""  # the copy workers' mover kind (`start(copy_mover=)`, `AttachArenas.mover`)
        self.device_events: DevicePublishers | None = None
        self.kv_events_interval_s = DEFAULT_INTERVAL_S  # the device publishers' batch interval (`start(...)`)
        self.tiers: list[RemoteTier] = []  # one per rank
        self.copiers: list[RemoteCopier] = []
        self.host_layouts: list[HostLayout] = []  # per rank
        self.host_segments: list[str] = []  # per rank
        self._segments: list[Segment] = []
        self._segment_names: list[str] = []
        self._closed = False
        self._finalizer = weakref.finalize(self, _unlink_all, self._segment_names)
        # Host tiers this store does not own (`kvproc up`, shared by several engines), one per rank: reached through
        # their manifest, watched by heartbeats (no sentinel to wait on), and never shut down by this store.
        self._external_tiers: list[RpcClient] = []
        self._external_token = ""
        self._too_few_shared_tiers = ""  # why a PER_RANK model cannot attach to the shared tiers ("": it can)
        self._tier_runtime_dir = ""  # where a shared tier's manifest is (read again when it is replaced)
        self.tier_reconnects = 0  # shared tiers reconnected after a stall
        # What re-attaching to a replaced shared tier needs (`_reattach`): per rank with a tier of its own, the
        # Configure it sent and the incarnation that answered; every rank's layout; whether one tier serves them all.
        self._configures: list[m.Configure] = []
        self._incarnations: list[int] = []
        # Per rank with a tier of its own: the eviction policy its index evicts by, as its `Configured` said (the
        # store's `StoreConfig.eviction`, or a shared tier's own `kvproc up --eviction`).
        self.tier_evictions: list[str] = []
        self._layouts: list[ArenaLayout] = []
        self._one_tier = False
        self.tier_reattaches = 0  # shared tiers replaced by another process and re-attached

    @classmethod
    def start(cls, host_bytes: int, *, name: str | None = None, ranks: int = 1, lease_ttl_s: float = 30.0,
              handoff_ttl_s: float = 300.0, save_ttl_s: float | None = None, reap_interval_s: float = 1.0,
              copy_timeout_s: float = 120.0, ready_timeout_s: float = 60.0, shutdown_deadline_s: float = 5.0,
              runtime_dir: str | None = None, max_restarts: int = 3, restart_window_s: float = 300.0,
              tier_runtime_dir: str | None = None, log_level: str = "info",
              cpus: Mapping[str, Sequence[int]] | None = None, metrics: str | None = None,
              kv_events: bool = False, device_kv_events: bool = False,
              kv_events_interval_s: float = DEFAULT_INTERVAL_S, kv_events_tokens: bool = False,
              remote: str | None = None, copy_mover: str = "") -> "ClusterStore":
        """Launch the host tier (if `host_bytes`) and one copy worker per rank; wait until all are up.

        `tier_runtime_dir` attaches to running shared host tiers instead (`kvproc up [--ranks N]`, found through
        their manifest; rank r to `host_tier[r]`); `host_bytes` is then the budget this engine asks of each.

        `cpus` pins kvproc's processes: {"copy_worker": [1], "host_tier": [1]} runs every rank's worker and tier on
        CPU 1, "copy_worker[2]" names one rank (it wins over the role's entry). Unnamed ones run wherever the OS
        puts them (the default). For machines with cores to spare: kvproc's processes off the engine's cores, near
        their GPU (`RoleConfig.cpus`; `kvproc bench ipc --kvproc-cpus` measures both ways).

        `metrics="HOST:PORT"` serves Prometheus `/metrics` of every process and the store (`kvproc/runtime/
        metrics.py`; port 0 picks a free one: `cs.cluster.metrics.address`). `kv_events=True` makes each host tier
        publish what it stores and removes (`kvproc/tiers/kv_events.py`; `kv_events.endpoints(runtime_dir, rank)`).
        `device_kv_events=True` makes each rank's device pool publish what its prefix index gains and loses, from
        this process once a model is attached (`store/device_events.py`; `endpoints(runtime_dir, rank, "device")`,
        in the manifest's `published`). A switch of its own: its publisher shares this process (and its GIL) with
        the resolves; batched (50 ms), it cost a resolve +1.3% / +3.4% in `kvproc bench ipc --observe-ab 8
        --device-events` on a loaded 2-vCPU box, about its noise (per change: +51-61%; bench/RESULTS.md).
        `kv_events_interval_s` is how long both gather changes into one batch (50 ms; (0, 3600] s, else ValueError
        before anything starts): shorter, a router learns sooner and the publisher wakes more often. Recorded in the
        manifest beside the endpoints (`kv_events_interval_ms`). A shared tier's (`tier_runtime_dir`) is its own
        (`kvproc up --kv-events-interval-ms`). `kv_events_tokens=True` (with `kv_events`) puts the pages' token ids
        in the host tiers' `BlockStored`: each save then carries its tokens to the tier (8 bytes a token in its
        ReserveSave); off, the save path is as without events.

        `remote="mooncake://HOST:PORT?metadata=..."` puts a Mooncake Store below each host tier (`kvproc/tiers/
        mooncake.py`: write-behind of committed pages, host-tier misses pulled from it; needs `kvproc[remote]`).
        Ignored with `tier_runtime_dir` (a shared tier's remote is `kvproc up --remote`).

        `copy_mover="torch"` makes the copy workers move CPU arenas with the torch rows mover (`kvproc/workers/
        torch_mover.py`: the GPU path's batch logic and executor, run on CPU); "" is the default (memmove on CPU, the
        staged cuda mover on GPU arenas); "cuda_mapped" moves GPU arenas with the mapped CUDA mover
        (`kvproc/workers/mapped_mover.py`, never run; refused for CPU arenas)."""
        if ranks < 1:
            raise ValueError(f"ranks must be >= 1, got {ranks}")
        kv_events_interval_s = check_interval(kv_events_interval_s)
        if kv_events_tokens and not kv_events:
            raise ValueError("kv_events_tokens=True puts token ids in the host tiers' KV events: it needs "
                             "kv_events=True")
        save_ttl_s = derived_save_ttl(copy_timeout_s, save_ttl_s, StoreConfig.tier_call_timeout_s)
        external: list[RpcClient] = []
        token = short = ""
        if tier_runtime_dir is not None:
            external, token, short = _connect_external_tiers(tier_runtime_dir, ranks, ready_timeout_s)
            host_bytes = host_bytes or 1
        name = name or f"cs{os.getpid()}x{next(_names)}"
        roles: list[RoleConfig] = []
        if host_bytes > 0 and not external:  # one host tier per rank, `host_bytes` each: ranks never share one
            roles += [RoleConfig("host_tier", r, log_level=log_level, options={
                "host_bytes": host_bytes, "lease_ttl_s": lease_ttl_s, "handoff_ttl_s": handoff_ttl_s,
                "save_ttl_s": save_ttl_s, "reap_interval_s": reap_interval_s, "kv_events": kv_events,
                "kv_events_interval_s": kv_events_interval_s, "kv_events_tokens": kv_events_tokens,
                "remote": remote or ""})
                for r in range(ranks)]
        roles += [RoleConfig("copy_worker", r, max_restarts=max_restarts, restart_window_s=restart_window_s,
                             log_level=log_level) for r in range(ranks)]
        if cpus:
            roles = _pinned(roles, cpus)
        try:
            cluster = launch(roles, cluster_name=name, runtime_dir=runtime_dir, ready_timeout_s=ready_timeout_s,
                             metrics=metrics)
        except BaseException:
            for c in external:
                c.close()
            raise
        cs = cls(cluster, host_bytes, ranks, copy_timeout_s=copy_timeout_s, shutdown_deadline_s=shutdown_deadline_s)
        cs._external_tiers = external
        cs._external_token = token
        cs._too_few_shared_tiers = short
        cs._tier_runtime_dir = tier_runtime_dir or ""
        cs.device_kv_events = device_kv_events
        cs.kv_events_interval_s = kv_events_interval_s
        cs.copy_mover = copy_mover
        # Its own tiers' reconnects (a shared tier's: `_reconnect_external`). Weakly: the cluster must not keep the
        # store alive (its finalizer unlinks the arenas of a store nobody closed).
        listener = weakref.WeakMethod(cs._tier_client_reconnected)
        cluster.reconnect_listeners.append(lambda role, rank: _call_if_alive(listener, role, rank))
        for r, client in enumerate(external):
            client.add_death_listener(functools.partial(cs._external_tier_dead, r, client))
        return cs

    def _external_tier_dead(self, rank: int, old: RpcClient, reason: str) -> None:
        """A shared tier's client was declared dead (heartbeats: it stalled; or it left). Runs on the client's I/O
        thread: the reconnect runs on its own."""
        if not self._closed:
            threading.Thread(target=self._reconnect_external, args=(rank, old, reason), daemon=True,
                             name="kvproc-tier-reconnect").start()

    def _reconnect_external(self, rank: int, old: RpcClient, reason: str) -> None:
        """Reconnect once a tier answers at the shared cluster's endpoint again, every 0.5 s until one does (the
        endpoint and token read again from the runtime dir each time: a restarted `kvproc up` writes new ones). The
        store's Configure, sent again, says which tier it is (`Configured.incarnation`; a pid cannot tell, a restarted
        container reuses pids): the same process (a stall) -- its leases, saves and slots stand, and what the stall
        kept back is sent; another one (`kvproc up` restarted on the dir) -- re-attached with nothing of the old one
        trusted (`_reattach`). A tier that refuses the store (another model's) is left: the store serves without."""
        log.warning("shared_tier_unresponsive", rank=rank, reason=reason)
        while not self._closed:
            try:
                endpoint, token = (_shared_tier_endpoint(self._tier_runtime_dir, rank) if self._tier_runtime_dir
                                   else (old.endpoint, self._external_token))
            except Exception:  # noqa: BLE001 - no manifest (yet), the tier not up: try again
                time.sleep(0.5)
                continue
            client = RpcClient(endpoint, token=token, name="engine", peer=old.peer)
            conf: m.Configured | None = None
            try:
                client.connect(1.0)
                if rank < len(self._configures):  # a model is attached: which tier is this?
                    conf = client.request(self._configures[rank], timeout=5.0)
            except RemoteError as e:  # it answered, and refused this store: not ours to use
                log.error("shared_tier_refused", rank=rank, code=e.code, error=str(e))
                client.close()
                return
            except Exception:  # noqa: BLE001 - not answering yet (or gone), or a stale token: try again
                client.close()
                time.sleep(0.5)
                continue
            if self._closed:
                client.close()
                return
            replaced = conf is not None and conf.incarnation != self._incarnations[rank]
            if replaced:
                assert conf is not None
                self._rebind(rank, conf)  # before the client is in place: nothing of the old tier reaches the new
            self._external_tiers[rank] = client
            client.add_death_listener(functools.partial(self._external_tier_dead, rank, client))
            old.close()
            if replaced:
                assert conf is not None
                self._rehost(rank, conf)
                self.tier_reattaches += 1
                log.warning("shared_tier_reattached", rank=rank, old_pid=old.server_pid, pid=client.server_pid,
                            segment=conf.segment)
            else:
                self.tier_reconnects += 1
                log.info("shared_tier_reconnected", rank=rank, pid=client.server_pid)
                self._tier_client_reconnected("host_tier", rank)
            return

    def _rebind(self, rank: int, conf: m.Configured) -> None:
        """A replaced tier, before the store's client to it is in place: the store's tier object speaks for the new
        one (the next epoch, no backlog of old ids)."""
        layout = layout_from_wire(conf.layout)
        self.tiers[rank].rebind(layout, conf.segment, wants_token_ids=conf.token_ids, wants_parent_key=conf.kv_events)
        self.host_layouts[rank], self.host_segments[rank] = layout, conf.segment
        self._incarnations[rank] = conf.incarnation
        self.tier_evictions[rank] = conf.eviction  # a replaced `kvproc up` may have been started with another one

    def _rehost(self, rank: int, conf: m.Configured) -> None:
        """The copy workers that used the replaced tier attach to the new tier's segment (as the next host epoch:
        a load from the old tier's slots is refused) and let go of the old one's. A worker that cannot keeps its old
        attachment: its loads from the new tier are then refused and recomputed, never read from the wrong slots."""
        for r in range(self.ranks) if self._one_tier else [rank]:
            wire = layout_to_wire(self.host_layouts[rank].for_layout(self._layouts[r])) if self._one_tier and r \
                else conf.layout
            try:
                self.copiers[r].rehost(conf.segment, wire, 10.0)
            except Exception as e:  # noqa: BLE001 - see above: its loads are refused, the store recomputes
                log.error("copy_worker_rehost_failed", rank=r, error=repr(e))

    def _tier_client_reconnected(self, role: str, rank: int) -> None:
        """A tier answers again after a stall, through a new client: what the stall kept back goes now (the aborts of
        saves whose tickets it swallowed among them: `RemoteTier.reconnected`)."""
        if role == "host_tier" and rank < len(self.tiers) and not self._closed:
            self.tiers[rank].reconnected()

    def _tier_client(self, rank: int = 0) -> RpcClient:
        return self._external_tiers[rank] if self._external_tiers else self.cluster.client("host_tier", rank)

    # Rank 0's tier, host layout and segment (a one-rank store's only ones); the lists hold every rank's.
    @property
    def tier(self) -> RemoteTier | None:
        return self.tiers[0] if self.tiers else None

    @property
    def host_layout(self) -> HostLayout | None:
        return self.host_layouts[0] if self.host_layouts else None

    @property
    def host_segment(self) -> str:
        return self.host_segments[0] if self.host_segments else ""

    # ---- arenas ----

    def allocator(self, name: str, nbytes: int) -> torch.Tensor:
        """(arena name, nbytes) -> a zeroed uint8 tensor backed by a segment this process owns (the copy workers
        attach it). Pass as a model's `allocator`."""
        del name  # segment names identify the owner (for sweeps), not the arena
        seg = Segment.create(self.cluster.name, ARENA_ROLE, nbytes)
        self._segments.append(seg)
        self._segment_names.append(seg.name)
        return seg.torch(torch.uint8, 0, nbytes)

    def _locate(self, arena: KvArena) -> tuple[str, int]:
        return self._locate_ptr(arena.tensor.data_ptr(), arena.name)

    def _locate_ptr(self, ptr: int, name: str) -> tuple[str, int]:
        for seg in self._segments:
            base = seg.address()
            if base <= ptr < base + seg.nbytes:
                return seg.name, ptr - base
        raise KvContractError(f"arena {name!r} was not allocated through ClusterStore.allocator: a copy worker"
                              " can only reach arenas in shared memory; build the model with allocator=cs.allocator")

    def _arena_refs(self, layout: ArenaLayout) -> list[m.ArenaRef]:
        refs = []
        for group, a in layout.arenas:
            cuda = None
            if a.tensor.is_cuda:  # NEVER RUN (no GPU where it was written): the engine's CUDA tensor, by CUDA IPC
                off, cuda = _cuda_ref(a)
                seg = ""
            else:
                seg, off = self._locate(a)
            stored = a.stored_bytes_per_block if a.stored_bytes_per_block not in (None, a.bytes_per_block) else 0
            refs.append(m.ArenaRef(group, layout.spec.group(group).kind.value, a.name, seg, off, a.num_blocks,
                                   a.bytes_per_block, a.block_stride, stored or 0, a.stored_layout or "", cuda))
        return refs

    # ---- the store ----

    def attach_model(self, model: KvModel, *, live_slots: int, config: StoreConfig = StoreConfig(),
                     repack: str | None = None, bounded_fraction: float = 0.25,
                     attach_timeout_s: float = 10.0, step_fence: StepFence | None = None) -> KvStore:
        """Configure the host tier for the model, attach every rank's copy worker, and return the `KvStore`.

        `repack` is the "module:function" import path of a `(group, direction, src, dst, arena)` callable (arena: an
        `ArenaId(name, index)`) the copy workers run for the blocks of every arena that declares a `stored_layout`:
        required then, and refused (`KvContractError` naming the arenas) when no arena declares one (it would never
        run). Attach runs sample rows through it and the model's own `repack` and refuses a pair that disagrees.

        A shared tier (`start(tier_runtime_dir=)`) configured for another fingerprint refuses the model:
        `FingerprintMismatch` (a `KvContractError`) naming both fingerprints.

        `step_fence` (an engine on a GPU whose steps run asynchronously): `step_fence(rank)` -> the CUDA IPC handle of
        the event recorded after its latest step on that rank, or None; every save and device copy the store issues
        then waits for it on the copy worker's stream (`KvStore`, docs/gpu.md). None: no fence."""
        if self.store is not None:
            raise RuntimeError("attach_model was already called: one store per ClusterStore")
        layouts = [validate_layout(model.spec(), model.arenas(r)) for r in range(self.ranks)]
        require_model_id(layouts[0].spec, type(model).__name__)  # before any process is configured (the fix is named)
        layouts[0].spec.check_sharding(self.ranks)
        # A REPLICATED model is stored once: rank 0's tier serves every rank (the other ranks' tiers stay unused).
        shared = self.ranks > 1 and layouts[0].spec.replicated
        if self._too_few_shared_tiers and not shared:
            raise RuntimeError(self._too_few_shared_tiers)
        differs = layouts[0].repacked_arenas
        if repack and not differs:
            raise KvContractError(
                f"{type(model).__name__}: repack={repack!r} was given but no arena declares a stored_layout, so it "
                f"would never run (arenas {[a.name for _, a in layouts[0].arenas]}); declare KvArena(..., "
                "stored_layout='my-layout-v1') on the arenas it converts, or drop repack=")
        if differs and repack:  # the workers' hook must be the model's: checked here, once, before any process
            check_hooks_agree(model, check_repack_hook(import_callable(repack), repack), layouts[0], repack)
        if differs and not repack:
            raise KvContractError(
                f"{type(model).__name__}: arenas {differs} declare a stored layout different from the execution one,"
                " so the copy workers need its repack: pass repack='package.module:function' (a (group, direction,"
                " src, dst, arena) callable importable in a worker process)")
        wires: list[m.HostLayoutSpec | None] = [None] * self.ranks
        if self.host_bytes > 0:  # each rank's shard goes to its own tier, configured with that rank's arenas
            required = [g.name for g in layouts[0].spec.restorable_bounded_groups if not g.optional]
            for r, layout in enumerate(layouts):
                if shared and r:
                    wires[r] = layout_to_wire(self.host_layouts[0].for_layout(layout))
                    continue
                planned = HostLayout.plan(layout, self.host_bytes, bounded_fraction)
                configure = m.Configure(fingerprint(model, layout), layout_to_wire(planned), required,
                                        eviction=config.eviction or "")
                try:
                    conf = self._tier_client(r).request(configure, timeout=attach_timeout_s)
                except RemoteError as e:
                    if e.code == "fingerprint_mismatch":  # a shared tier serving another model: the page's typed error
                        raise FingerprintMismatch(f"host tier[{r}] refused {type(model).__name__}: {e.message}") from e
                    raise
                self._configures.append(configure)  # sent again on a reconnect: it says which tier answers
                self._incarnations.append(conf.incarnation)
                self.tier_evictions.append(conf.eviction)
                wires[r] = conf.layout
                self.host_segments.append(conf.segment)
                self.host_layouts.append(layout_from_wire(conf.layout))  # a joined tier's layout wins over our plan
                self.tiers.append(RemoteTier(functools.partial(self._tier_client, r), self.host_layouts[r],
                                             segment=conf.segment, wants_token_ids=conf.token_ids,
                                             wants_parent_key=conf.kv_events))
        for r, layout in enumerate(layouts):
            # The rank's load-fence words, in a segment this process owns (the worker maps it with the arenas).
            words = self.allocator(f"load_fences{r}", 8 * LOAD_FENCE_WORDS)
            fence_seg, fence_off = self._locate_ptr(words.data_ptr(), f"load_fences{r}")
            segment = self.host_segments[0 if shared else r] if self.host_segments else ""
            msg = m.AttachArenas(self._arena_refs(layout), segment,
                                 wires[r], repack or "", layout.spec.page_tokens, fence_seg, fence_off,
                                 LOAD_FENCE_WORDS, self.copy_mover)
            copier = RemoteCopier(self._copy_client(r), msg, copy_timeout_s=self.copy_timeout_s,
                                  load_fences=LoadFences(words.numpy().view(np.int64)))
            copier.attach_now(attach_timeout_s)  # fail here (bad repack path, bad arena) rather than at first copy
            self.copiers.append(copier)
        self._layouts, self._one_tier = layouts, shared
        tiers = self.tiers * self.ranks if shared else self.tiers
        self.store = KvStore(layouts, live_slots=live_slots, tiers=tiers or None, copiers=self.copiers, config=config,
                             step_fence=step_fence)
        self.cluster.counter_providers.append(self.store.counters_flat)  # `kvproc console status` shows them
        if self.device_kv_events:
            self.device_events = DevicePublishers.start(self.store, self.cluster.runtime_dir,
                                                        batch_interval_s=self.kv_events_interval_s)
            self.cluster.counter_providers.append(self.device_events.counters)
            self.cluster.publish(self.device_events.published())
        return self.store

    def _copy_client(self, rank: int) -> Any:
        return lambda: self.cluster.client("copy_worker", rank)

    # ---- lifetime ----

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if self.store is not None:
                self.store.close()
            if self.device_events is not None:
                self.device_events.close()
            for c in self.copiers:
                c.close()
            for t in self.tiers:
                t.close()
            for client in self._external_tiers:
                client.close()
        finally:
            # The launcher's janitor keeps watching until the arenas below are unlinked too: a kill in between
            # leaves nothing either.
            self.cluster.shutdown(self.shutdown_deadline_s, stop_janitor=False)
            for seg in self._segments:
                seg.unlink()
                try:
                    seg.close()
                except SegmentBusyError:
                    pass  # the model still views it: the memory goes with the last view (the name is gone now)
            self._finalizer.detach()
            self.cluster.stop_janitor()

    def __enter__(self) -> "ClusterStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ClusterStore", "fingerprint"]
