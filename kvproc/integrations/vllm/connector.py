"""`KvprocConnector`: kvproc as the host tier of a vLLM engine (vLLM's KV connector API, v1).

Load it with
    kv_transfer_config={"kv_connector": "KvprocConnector",
                        "kv_connector_module_path": "kvproc.integrations.vllm.connector", "kv_role": "kv_both"}

vLLM's own prefix cache stays the device tier; kvproc's host tier is the tier below it. Every page moves in one copy
each way, between vLLM's blocks and the host tier's slots (`kvproc/store/host_direct.py`: the engine maps the tier's
shared-memory segment; a lookup leases slots, a save reserves them and writes them holding their fence).

- intake (`get_num_new_matched_tokens`): the request's page keys under kvproc's hash chain (scoped by `cache_salt` and
  the LoRA adapter) and a lookup that leases the longest prefix the tier holds. Tokens beyond vLLM's own hit are
  reported to vLLM, which allocates blocks for them; a lookup still running makes vLLM ask again at its next step
  (never a wait on its scheduler thread past `resolve_wait_s`).
- a hit beyond vLLM's own lands before the forward of the step that schedules the request (`loads="sync"`, the
  default for a model of one KV cache group at one rank: the step's meta carries the load, `start_load_kv` waits for
  the mover) or is asynchronous (`(n, True)`, the default otherwise: vLLM allocates the blocks and holds the request
  back, the mover copies beside a forward, `get_finished` reports the request once the load settled, and vLLM
  schedules it a step later). Either way the engine's mover thread (`moves.py`) copies, and checks after the copy
  that the leased slots were still the hit's.
- each page that becomes full in a step is saved (vLLM block -> the tier's slot): `wait_for_save` hands the step's
  saves to the mover and returns; vLLM's forward thread never waits for a save.
- the scheduler side reads settled moves at its next entry point (`_drain`): a saved page is the tier's, a loaded
  hit's lease is released.
- `request_finished`: with a save still in flight it returns True (vLLM keeps the blocks until `get_finished`
  reports the request sent). A preempted request's save in flight is waited for in `handle_preemptions`, before
  vLLM's forward reuses its blocks.

P/D (`kv_role="kv_producer"` / `"kv_consumer"`, docs/vllm.md): the producer also saves the prompt's partial last
page in the prefill step, pads and seals it all with `SaveClass.HANDOFF`, and `request_finished` returns kvproc's
`HandoffEnvelope` as `kv_transfer_params`; a consumer request carrying it is checked against this engine's
fingerprint; the producer's HANDOFF saves go straight into the tier's slots and the consumer leases the whole padded
chain there (`handoff_direct.py`) and loads it straight into vLLM's blocks, as any hit, at any TP. A model with state
groups hands off up to its deepest checkpoint (a page boundary): vLLM keeps no state inside a page.

Nothing here can make vLLM wait forever or compute with wrong KV: a lookup that fails is a miss; a load that fails
reports its blocks to vLLM (`get_block_ids_with_load_errors`: vLLM recomputes them); a save that fails is a future
miss; a move that fails is one of those (`moves.py` says it once per outage).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import time
import multiprocessing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec
import numpy as np
import structlog
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvproc import (
    PAD_TOKEN_ID,
    FingerprintMismatch,
    ForeignHandleError,
    HandoffEnvelope,
    HashScope,
    KvContractError,
    SaveClass,
    chain_key,
    check_envelope,
    check_fingerprint,
    fingerprint,
)
from kvproc.integrations.vllm import proxy_common
from kvproc.integrations.vllm import runtime as rt_mod
from kvproc.integrations.vllm.contract import VllmKvContract, contract_from_vllm, model_identity
from kvproc.integrations.vllm.event_forward import TierEventForwarder
from kvproc.integrations.vllm.handoff_direct import full_hit, full_hit_ranked, handoff_keys, padded_tail_key
from kvproc.integrations.vllm.moves import NULL_BLOCK, CopyJob, MoveQueue
from kvproc.integrations.vllm.sglang_format import SglangKeys, SglangPages
from kvproc.integrations.vllm.tp import KvprocWorkerMeta, RankedTier, TierAttach, WorkerRuntime
from kvproc.store.cluster import fingerprint as tier_fingerprint
from kvproc.store.types import check_retain_s
from kvproc.store.tier_slots import TierSlots
from kvproc.tiers.host_index import Hit, SaveTicket
from kvproc.workers.movers import MEMMOVE

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from kvproc.store.host_direct import HostDirect

log = structlog.get_logger("kvproc.integrations.vllm")

# The key of kvproc's hand-off envelope in vLLM's `kv_transfer_params` (the producer's RequestOutput carries it; the
# consumer's request is given it through SamplingParams.extra_args["kv_transfer_params"]).
HANDOFF_KEY = "kvproc_handoff"
# The serving layer's retention hint in a request's `kv_transfer_params`: seconds within which the conversation is
# expected back (docs/store.md, "Retention hint"); the request's pages are then kept ahead of un-hinted ones.
RETAIN_KEY = proxy_common.RETAIN_KEY

# What `_result` returns for a resolve or lookup still running.
_PENDING = object()

# The longest a step in which vLLM scheduled nothing waits in `get_finished` for one of our moves to settle.
IDLE_WAIT_S = 0.02


# ---- what travels scheduler -> worker and back ------------------------------------------------------------------

@dataclass
class KvprocConnectorMetadata(KVConnectorMetadata):
    loads: list[CopyJob] = field(default_factory=list)  # tier -> vLLM, landed before the forward (loads="sync")
    async_loads: list[CopyJob] = field(default_factory=list)  # tier -> vLLM, for requests vLLM holds back
    saves: list[CopyJob] = field(default_factory=list)  # vLLM -> tier, after the forward, not waited for
    failed_loads: list[int] = field(default_factory=list)  # vLLM blocks promised but not loadable: recompute
    failed_load_reqs: list[str] = field(default_factory=list)  # the same, by request (several KV cache groups)
    wait_jobs: list[int] = field(default_factory=list)  # saves of preempted requests: done before vLLM reuses blocks
    unloaded: list[str] = field(default_factory=list)  # requests held back for a load that could not be planned
    async_started: bool = False  # the worker side submitted async_loads (at handle_preemptions, before the forward)
    # Tensor parallel (`tp.py`): where each rank's tier is, and the finished requests whose free waits for a save
    tiers: TierAttach | None = None
    delayed: list[str] = field(default_factory=list)
    # ... and, for a model with sliding-window groups, the saves still unsettled on the scheduler's side: each rank
    # lands its part before this step's forward may overwrite a block a window gave back (`handle_preemptions`)
    flush_jobs: list[int] = field(default_factory=list)
    tp_taken: bool = False  # the worker side read the three above
    idle: bool = False  # vLLM scheduled no token this step: it only waits for moves (see get_finished)


# ---- the scheduler side's per-request state -----------------------------------------------------------------------

@dataclass(eq=False)
class _Req:
    req_id: str
    request: "Request"
    asked: bool = False  # vLLM asked for this request's hit before (its lookup then got resolve_wait_s)
    # vLLM's block table, one list per KV cache group (NULL_BLOCK where a group keeps no block for a page)
    vllm_blocks: list[list[int]] = field(default_factory=list)
    # A load vLLM accepted at intake: (tokens vLLM had itself, tokens to load); turned into a job at the next meta.
    pending_load: tuple[int, int] | None = None
    job: int | None = None  # the save in flight (one at a time: the next plans from where it ends)
    retain_s: float | None = None  # the request's retention hint (`RETAIN_KEY`), applied once its saves settled
    load_job: int | None = None  # the load in flight into vLLM's blocks (its source pinned until it settles)
    finishing: bool = False
    saving: bool = True  # False once a save could not be planned or failed: no more for this request
    handoff: HandoffEnvelope | None = None  # P/D consumer: the producer's envelope
    padded: bool = False  # P/D producer: the partial last prompt page is padded and planned
    # State groups: the deepest page boundary whose checkpoint this request sealed (a P/D producer's hand-off ends
    # there: vLLM keeps a state only at page boundaries, so the consumer computes the prompt's tail itself)
    checkpoint_at: int = 0
    restore_at: int = 0  # the hit's tokens (state groups: where its checkpoint is)
    # The lookup in flight, the lease on the hit's host slots until vLLM's blocks have them, the prompt's (then the
    # request's) page hashes, and how many pages the tier has of it.
    lookup: concurrent.futures.Future[Any] | None = None  # a Hit, every rank's (tensor parallel), or None
    tracked: bool = False  # kvproc follows this request's pages (False: it cannot be keyed; vLLM serves it alone)
    lease: Hit | None = None
    hashes: list[bytes] = field(default_factory=list)
    saved: int = 0
    save_to: int = 0  # the pages the tier has once the save in flight lands
    leased_at: float = 0.0  # when the lookup's answer came (a lease too old is not trusted: `HostDirect.intact`)
    leases: list[Hit] = field(default_factory=list)  # tensor parallel: every rank's (`lease` is rank 0's)
    chain: list[str] = field(default_factory=list)  # page_format="sglang": SGLang's page keys behind `hashes`


def _scope(request: "Request") -> HashScope:
    """What besides the tokens must match for KV to be shared: vLLM's cache_salt and the LoRA adapter."""
    lora = getattr(request, "lora_request", None)
    return HashScope(cache_salt=getattr(request, "cache_salt", None) or "",
                     lora_name=f"{lora.lora_name}#{lora.lora_int_id}" if lora is not None else "")


class KvprocConnector(KVConnectorBase_V1, SupportsHMA):
    """kvproc as vLLM's host tier. Scheduler-side and worker-side halves share one `KvprocRuntime` per engine.

    `SupportsHMA`: vLLM keeps its hybrid KV cache manager (one block table per KV cache group: sliding-window and
    full-attention layers apart) with this connector; without it vLLM would promote sliding layers to full attention
    (the whole KV kept) or refuse a hybrid model at start."""

    # vLLM's per-source hit metrics: kvproc's host tier is host memory.
    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)  # type: ignore[arg-type, unused-ignore]
        pc = vllm_config.parallel_config
        if pc.world_size != pc.tensor_parallel_size:
            raise KvContractError(f"KvprocConnector supports tensor parallelism only (tensor_parallel_size="
                                  f"{pc.tensor_parallel_size}, pipeline_parallel_size={pc.pipeline_parallel_size}, "
                                  f"world_size={pc.world_size})")
        self.ranks = pc.tensor_parallel_size
        # Tensor parallel: vLLM's workers are processes of their own (daemonic: they start nothing); the store is the
        # scheduler side's (`tp.py`).
        self._tp_worker = self.ranks > 1 and role == KVConnectorRole.WORKER
        if multiprocessing.current_process().daemon and not self._tp_worker:
            # vLLM's CPU platform runs even one rank in a daemonic worker process unless told otherwise: kvproc can
            # start no process there, and this half would not share the runtime with the scheduler's half.
            raise KvContractError("KvprocConnector: vLLM runs the model in a separate (daemonic) worker process; on "
                                  "CPU set VLLM_ENABLE_V1_MULTIPROCESSING=0 (one rank: the model then runs in the "
                                  "engine-core process, beside vLLM's scheduler)")
        if vllm_config.speculative_config is not None:
            raise KvContractError("KvprocConnector does not support speculative decoding yet")
        if kv_cache_config is None:
            raise KvContractError("KvprocConnector needs vLLM's kv_cache_config (vLLM >= 0.11 passes it)")
        ktc = vllm_config.kv_transfer_config
        assert ktc is not None
        if ktc.kv_role not in ("kv_both", "kv_producer", "kv_consumer", None):
            raise KvContractError(f"KvprocConnector: kv_role={ktc.kv_role!r} is not supported")
        # P/D: every request a producer finishes is handed off; a consumer adopts the requests that carry an envelope.
        self.producer = ktc.kv_role == "kv_producer"
        # Async scheduling plans step N+1 while step N's forward may still run: a state read at N+1's planning might
        # not be written yet (`_offer_prompt_ends` reads one only under sync scheduling).
        self._async_scheduling = bool(getattr(vllm_config.scheduler_config, "async_scheduling", False))
        self._consumer = ktc.kv_role == "kv_consumer"
        self.options = rt_mod.RuntimeOptions.from_extra(ktc.kv_connector_extra_config)
        self.contract: VllmKvContract = contract_from_vllm(kv_cache_config,
                                                           model_id=model_identity(vllm_config, self.options.model_id))
        self.page = self.contract.block_tokens
        self._groups = len(self.contract.groups)
        if self._groups > 1 and self.options.loads == "sync":
            raise KvContractError("KvprocConnector: loads='sync' needs a model of one KV cache group: vLLM cannot hear "
                                  "of a failed synchronous load of several groups")
        if self.ranks > 1:
            self._check_tp(ktc.kv_role)
        # Synchronous loads save vLLM a step per hit (the request runs in the step that schedules it); vLLM recomputes
        # a failed one by block id, which names a block only with one KV cache group (`get_block_ids_with_load_errors`).
        self._sync_loads = self.options.loads == "sync" or (
            self.options.loads == "auto" and self._groups == 1 and self.ranks == 1)
        if role == KVConnectorRole.SCHEDULER and self.options.load_failure_policy == "recompute" and \
                ktc.kv_load_failure_policy != "recompute":
            # vLLM reads it after building this half (its scheduler): a failed load is then recomputed, not an error.
            log.info("kvproc_load_failures_recomputed", vllm_policy_was=ktc.kv_load_failure_policy)
            ktc.kv_load_failure_policy = "recompute"
        engine_id = str(ktc.engine_id)
        # page_format="sglang": pages keyed and laid out as kvproc's SGLang backend stores them (`sglang_format.py`)
        self._sgl = self._sglang_pages(kv_cache_config) if self.options.page_format == "sglang" \
            else None
        self._sgl_keys: SglangKeys | None = None
        self.rank = 0
        self.ranked: RankedTier | None = None  # tensor parallel, the scheduler side: every rank's tier
        self._tier_slots: TierSlots | None = None  # tensor parallel, a worker: its rank's tier, mapped
        self._tier_wanted: TierAttach | None = None  # ... the tiers the latest step named (mapped by the mover)
        self._tier_mapped: tuple[str, int] = ("", -1)  # ... the (segment, epoch) `_tier_slots` is of
        self._delayed_next: list[str] = []  # tensor parallel: frees delayed since the last meta (sent in the next)
        if not self._tp_worker:
            self.rt = rt_mod.acquire(engine_id, self.contract, self.options,
                                     ranks=self.ranks, tier_model=self._sglang_model())
            self.direct = self.rt.direct
            self.hasher = self.rt.store.pools[0].hasher
            self.store = self.rt.store
            if self.ranks > 1:
                self.ranked = RankedTier(self.rt.directs, self.ranks)
                self._tier_attach = self.ranked.attach
            # Equal strings mean a producer's KV can be restored here (weights, shapes, stored layout, page, hashing).
            self.fingerprint = fingerprint("vllm", self.store.layouts[0], self.store.pools[0].hasher.algorithm)
            if self._sgl is not None:  # the SGLang backend's key namespace: its tier fingerprint, this one's too
                self._sgl_keys = SglangKeys(tier_fingerprint(self.rt.model, self.store.layouts[0]), self.page)
        else:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

            self.rank = get_tensor_model_parallel_rank()
            # Its moves and counters only: the store is the scheduler side's (the worker's code reads no more of it).
            self.rt = WorkerRuntime()  # type: ignore[assignment]
            self.direct = None
            self.fingerprint = ""
        self._closed = False
        # scheduler side
        self._reqs: dict[str, _Req] = {}
        self._jobs: dict[int, _Req] = {}
        self._loads: dict[int, _Req] = {}  # load job -> its request (its lease is released once the load settled)
        self._async_ready: list[_Req] = []  # requests vLLM holds back for a load: planned at the next meta
        self._job_ids = itertools.count(1)
        # worker side
        # layer -> vLLM's tensor / the tier's arena, as [blocks, bytes_per_block] uint8 arrays (views, no copy)
        self._kv: dict[str, np.ndarray] = {}
        self._tier: dict[str, np.ndarray] = {}
        self._load_errors: set[int] = set()
        self._receiving: set[str] = set()  # requests whose asynchronous load was submitted, not yet reported
        self._sending: set[str] = set()  # finished requests whose delayed free waits for their saves
        self._events: TierEventForwarder | None = None  # the host tier's KV events into vLLM's stream
        kec = vllm_config.kv_events_config
        if (role == KVConnectorRole.SCHEDULER and self.options.kv_events and self.options.kv_events_into_vllm
                and kec is not None and kec.enable_kv_cache_events and not self._tp_worker):
            tiers = rt_mod.kv_event_endpoints(self.options.tier_runtime_dir or self.rt.cluster.cluster.runtime_dir)
            tier = tiers["host_tier[0]"]
            self._events = TierEventForwarder(tier["kv_events"], tier["kv_events_replay"])
        self._failed_recving: set[str] = set()  # requests whose async load failed (several groups: by request)
        # State groups: the boundary states vLLM offered at the last step (req -> (group, block, boundary tokens))
        self._offers: dict[str, list[tuple[int, int, int]]] = {}
        log.info("kvproc_connector", role=role.name, engine_id=engine_id, page_tokens=self.page, rank=self.rank,
                 ranks=self.ranks, layers=len(self.contract.layer_names),
                 groups=[g.vllm_spec for g in self.contract.groups])

    def _sglang_pages(self, kv_cache_config: "KVCacheConfig") -> SglangPages:
        """page_format="sglang": what it serves (one rank's full-attention KV on the direct path, the roles that
        cache), refused by name otherwise, and the SGLang page of this engine's blocks."""
        why = ""
        if self.ranks > 1:
            why = f"tensor_parallel_size={self.ranks} (one rank's pages only)"
        elif self.producer or self._consumer:
            why = "P/D roles (a hand-off is keyed by kvproc's padded chain)"
        elif [g.vllm_spec for g in self.contract.groups] != ["FullAttentionSpec"]:
            why = f"KV cache groups {[g.vllm_spec for g in self.contract.groups]} (one FullAttentionSpec group only)"
        if why:
            raise KvContractError(f"KvprocConnector: page_format='sglang' does not serve {why}")
        spec = kv_cache_config.kv_cache_groups[0].kv_cache_spec
        return SglangPages.for_vllm(self.options.sglang_layout, self.contract.groups[0].layer_names,
                                    int(spec.num_kv_heads), int(spec.head_size),
                                    int(getattr(spec, "head_size_v", None) or spec.head_size),
                                    spec.dtype.itemsize, str(spec.dtype).removeprefix("torch."), self.page)

    def _sglang_model(self) -> Any:
        """The tier model of page_format="sglang": the SGLang backend's own (`SglangPageModel`, its zero-copy
        format), so that both attach to one tier under one fingerprint. None: the layout model of vLLM's blocks."""
        if self._sgl is None:
            return None
        from kvproc.integrations.sglang.model import SglangPageModel

        fmt, model_id = self._sgl.format, self.contract.spec.model_id
        return lambda allocator: SglangPageModel(fmt, model_id, True, allocator)

    def _check_tp(self, kv_role: str | None) -> None:
        """What tensor parallel carries today (`tp.py`): every KV kind, asynchronous loads, P/D
        (`handoff_direct.py`)."""
        if self.options.loads == "sync":
            raise KvContractError(f"KvprocConnector: tensor_parallel_size={self.ranks} is not supported here: "
                                  "loads='sync' waits for moves that run in the ranks' processes")

    # ============================ worker side ============================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        c = self.contract
        missing = [n for n in c.layer_names if n not in kv_caches]
        if missing:
            raise KvContractError(f"KvprocConnector: vLLM registered no KV tensor for layer(s) {missing}")
        if self._sgl is not None:
            self._check_sglang_tensors(kv_caches)
        for g in c.groups:
            row, stride = g.bytes_per_block, g.stride
            for name in g.layer_names:
                t = kv_caches[name]
                # One page per block in vLLM 0.32's CPU layout (attention [B, H, N, K+V], MLA [B, 1, N, latent], a
                # state [B, 1, 1, real bytes] in a page padded to `stride`); the groups' views overlay one buffer,
                # each block id owned by one group at a time.
                per_block = t[0].numel() * t.element_size() if t.dim() and t.shape[0] else 0
                if t.shape[0] != c.vllm_num_blocks or per_block != row or t.stride(0) * t.element_size() != stride \
                        or not t[0].is_contiguous():
                    raise KvContractError(
                        f"KvprocConnector: layer {name!r} ({g.vllm_spec}): vLLM's KV tensor {tuple(t.shape)} {t.dtype} "
                        f"is not {c.vllm_num_blocks} blocks of {row} bytes, {stride} bytes apart")
                # [blocks, stride] bytes over vLLM's buffer (the padding after each state included, never copied)
                per = t.stride(0)
                self._kv[name] = torch.as_strided(t, (c.vllm_num_blocks, per), (per, 1)).view(torch.uint8).numpy()
                # kvproc's side of every copy: the host tier's slots (a TP rank's are mapped when its first step
                # names its tier; page_format="sglang": one row per page for every layer, mapped below)
                if self._sgl is None and self.direct is not None:
                    self._tier[name] = self.direct.views[f"vllm.{name}"]
        if self._sgl is not None and self.direct is not None:
            self._map_tier_views(self.direct.slots, None)
        if self.rt.moves is None:
            self.rt.moves = MoveQueue(self._copy)

    def _check_sglang_tensors(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """page_format="sglang" reads vLLM-CPU's attention block layout ([blocks, kv heads, tokens, K and V]); any
        other tensor shape (another attention backend's) is refused rather than repacked wrongly."""
        assert self._sgl is not None
        want = (self.contract.vllm_num_blocks, self._sgl.heads, self.page, 2 * self._sgl.head_bytes)
        for name in self._sgl.layers:
            t = kv_caches[name]
            got = (*t.shape[:3], t.shape[3] * t.element_size()) if t.dim() == 4 else tuple(t.shape)
            if got != want or not t.is_contiguous():
                raise KvContractError(f"KvprocConnector: page_format='sglang' needs vLLM-CPU's attention layout "
                                      f"[blocks, kv heads, tokens, K and V] ({want}, bytes last), layer {name!r} has "
                                      f"{tuple(t.shape)} {t.dtype}")

    @property
    def _moves(self) -> MoveQueue:
        assert self.rt.moves is not None, "register_kv_caches comes first"
        return self.rt.moves

    def _copy(self, jobs: list[CopyJob], to_vllm: bool) -> None:
        """All of one batch's jobs of one direction, on the mover thread (`moves.py`); raises on failure. A save (one
        job a batch) reserves its slots in the tier first, writes them holding the save's fence and commits
        (`HostDirect.save`); a load (one job a batch) is checked after the copy: its leased slots must still be the
        hit's."""
        if self._tp_worker:
            self._copy_rank(jobs, to_vllm)
            return
        assert self.direct is not None
        self._follow_replaced_tier()
        if not to_vllm:
            for j in jobs:
                if not self.direct.save(j.req_id, j.keys, functools.partial(self._write_save, j),
                                        bounded_groups=j.bounded, save_class=self._save_class, parent=j.parent,
                                        tokens=j.tokens):
                    raise RuntimeError(f"request {j.req_id!r}: the host tier did not take the save (its outcome says "
                                       "why)")
            return
        self._copy_rows(jobs, to_vllm)
        now = time.monotonic()
        for j in jobs:
            if j.leased_at and j.epoch != self.direct.epoch:
                self.rt.count("loads_tier_replaced")
                raise RuntimeError(f"request {j.req_id!r}: its lease is of a host tier since replaced: its slots "
                                   "are not the new tier's (vLLM recomputes)")
            if j.leased_at and not self.direct.intact(j.slots, j.gens, j.leased_at, now):
                self.rt.count("loads_lease_lost")
                raise RuntimeError(f"request {j.req_id!r}: its lease on the host tier's slots was too old or a "
                                   "slot was handed to a save: the copy is not trusted (vLLM recomputes)")

    def _follow_replaced_tier(self) -> None:
        """On the mover thread, before a copy: a shared tier replaced under this engine (`kvproc up` restarted;
        the store re-attached) has another segment; the copies go to the new one from here on, and the old mapping
        is let go of once nothing here refers to it."""
        assert self.direct is not None
        old = self.direct.remap_if_replaced()
        if old is not None:
            self._map_tier_views(self.direct.slots, old, segment=self.direct.segment, epoch=self.direct.epoch)

    def _map_tier_views(self, slots: TierSlots, old: TierSlots | None, **where: Any) -> None:
        """The copies go through `slots`' views from here on; a replaced tier's mapping `old` is let go of (nothing
        here refers to it any more), counted and logged with `where`. On the one thread that copies."""
        if self._sgl is not None:  # one arena: a row per page, every layer in it
            arena = self.rt.model.arena_name
            self._tier[arena] = slots.views[arena]
        else:
            for name in self.contract.layer_names:
                self._tier[name] = slots.views[f"vllm.{name}"]
        if old is not None:
            old.close()
            self.rt.count("tier_remapped")
            log.warning("kvproc_tier_remapped", **where)

    def _copy_rank(self, jobs: list[CopyJob], to_vllm: bool) -> None:
        """A tensor-parallel worker's part of a direct move (`tp.py`): its rank's slots, reserved or leased by the
        scheduler side; a save written holding its fence, a load checked after the copy."""
        slots, epoch = self._follow_rank_tier()
        for j in jobs:
            if not to_vllm:
                save = j.rank_saves[self.rank]
                rows = self._new_rows(j, save.slots, self._state_rows(j, save.bounded))
                if rows.slots or rows.states:  # else nothing of it is this rank's to write (a REPLICATED model's
                    # other ranks; pages its tier has already)
                    slots.write_fenced(save.fence, save.token, functools.partial(self._copy_rows, [rows], False))
                continue
            if j.rank_epochs and j.rank_epochs[self.rank] != epoch:
                self.rt.count("loads_tier_replaced")
                raise RuntimeError(f"request {j.req_id!r}: its lease is of rank {self.rank}'s host tier since "
                                   "replaced: its slots are not the new tier's (vLLM recomputes)")
            mine = CopyJob(j.job_id, j.req_id, j.rank_slots[self.rank], j.vllm,
                           j.rank_states[self.rank] if j.rank_states else [])
            self._copy_rows([mine], True)
            if not slots.intact(mine.slots, j.rank_gens[self.rank], j.leased_at, time.monotonic()):
                self.rt.count("loads_lease_lost")
                raise RuntimeError(f"request {j.req_id!r}: its lease on rank {self.rank}'s host tier slots was too old "
                                   "or a slot was handed to a save: the copy is not trusted (vLLM recomputes)")

    def _follow_rank_tier(self) -> tuple[TierSlots, int]:
        """On the mover thread, before a copy: this rank's tier as the latest step named it, mapped (the first time,
        or in place of a replaced tier's segment, which is let go of: the copies go to the new one from here on),
        and the epoch of that mapping. Only this thread copies, so no copy is using the old views."""
        want = self._tier_wanted
        if want is None:
            raise RuntimeError("no step has named this rank's host tier yet")
        target = (want.segments[self.rank], want.epochs[self.rank] if want.epochs else 0)
        if self._tier_slots is None or target != self._tier_mapped:
            new = TierSlots(target[0], want.layouts[self.rank])
            old, self._tier_slots, self._tier_mapped = self._tier_slots, new, target
            self._map_tier_views(new, old, rank=self.rank, segment=target[0], epoch=target[1])
        assert self._tier_slots is not None
        return self._tier_slots, self._tier_mapped[1]

    def _take_tp_meta(self, meta: KvprocConnectorMetadata) -> None:
        """A TP worker's share of the step's meta: its rank's tier (mapped by the mover before its next copy:
        `_follow_rank_tier`), and the frees the scheduler delayed for saves (reported once this rank's moves of the
        request settled)."""
        if not self._tp_worker or meta.tp_taken:
            return
        meta.tp_taken = True
        if meta.tiers is not None:
            self._tier_wanted = meta.tiers
        for req_id in meta.delayed:
            self._moves.delay_free(req_id)

    def build_connector_worker_meta(self) -> KvprocWorkerMeta | None:
        """A TP worker's report of the moves that ended since the last step (the scheduler side settles a job once
        every rank reported it). One rank's engine reads its mover directly."""
        if not self._tp_worker or self.rt.moves is None:
            return None
        done = self.rt.moves.drain()
        return KvprocWorkerMeta({(self.rank, job_id): ok for job_id, ok in done}) if done else None

    def _write_save(self, job: CopyJob, ticket: SaveTicket) -> None:
        """A direct save's bytes into the slots of its ticket: pages the tier has already (slot None) and state groups
        whose checkpoint it has are skipped."""
        self._copy_rows([self._new_rows(job, ticket.page_slots, self._state_rows(job, ticket.bounded_slots))], False)

    def _new_rows(self, job: CopyJob, slots: Sequence[int | None], states: list[tuple[int, int, int]]) -> CopyJob:
        """`_new_pages`, refusing (the save fails, its slots go back) a slot reserved for a page of which vLLM kept no
        block in a paged group: only a P/D producer's leased pages may lack one, and the tier holds those."""
        rows = _new_pages(job, slots, states)
        if any(NULL_BLOCK in ids for g, ids in zip(self.contract.groups, rows.vllm) if not g.state):
            raise RuntimeError(f"request {job.req_id!r}: the tier asked for a page vLLM keeps no block of")
        return rows

    def _state_rows(self, job: CopyJob, bounded: dict[str, int | None]) -> list[tuple[int, int, int]]:
        """A save's state copies into the checkpoint slots a tier reserved (None: that tier has the checkpoint)."""
        by_index = {g.index: g.name for g in self.contract.states}
        return [(gi, slot, b) for gi, _, b in job.states if (slot := bounded.get(by_index[gi])) is not None]

    def _copy_rows(self, jobs: list[CopyJob], to_vllm: bool) -> None:
        """Runs of consecutive blocks on both sides are coalesced: one memcpy (or one iovec) per run per layer.
        (torch's `index_copy_` on uint8 rows moves ~0.13 GiB/s here against ~4.7 GiB/s for this: bench/RESULTS.md,
        "vLLM connector".)"""
        if self._sgl is not None:
            self._copy_sglang_rows(jobs, to_vllm)
            return
        slots_all = np.fromiter((b for j in jobs for b in j.slots), dtype=np.int64)
        pages = 0
        for g in self.contract.groups:
            if g.state:
                pairs = [(slot, b) for j in jobs for gi, slot, b in j.states if gi == g.index]
                slot_ids, vllm_ids = [s_ for s_, _ in pairs], [b for _, b in pairs]
            else:
                ids = np.fromiter((b for j in jobs for b in j.vllm[g.index]), dtype=np.int64)
                keep = ids != NULL_BLOCK  # a page this group keeps no block for (out of a sliding window)
                vllm_ids, slot_ids = ids[keep].tolist(), slots_all[keep].tolist()
            if not vllm_ids:
                continue
            pages += len(vllm_ids)
            # by group: hits by kind of KV (a sliding window's group loads only its window's pages)
            self.rt.count(f"{'pages_loaded' if to_vllm else 'pages_saved'}.{g.name}", len(vllm_ids))
            row, vstride = g.bytes_per_block, g.stride
            for name in g.layer_names:
                vk, sk = self._kv[name], self._tier[name]
                # One native call per layer, the GIL released for all of it (gil_bytes=0): a numpy copy per run
                # gets the GIL back after each run, and while vLLM's engine thread runs Python that is a wait of up
                # to the interpreter's switch interval (5 ms) per run: it made moves ~20x slower than memcpy.
                if to_vllm:
                    MEMMOVE.rows(vk.reshape(-1), vstride, vllm_ids, sk.reshape(-1), row, slot_ids, row, 0)
                else:
                    MEMMOVE.rows(sk.reshape(-1), row, slot_ids, vk.reshape(-1), vstride, vllm_ids, row, 0)
        self.rt.count("pages_loaded_into_vllm" if to_vllm else "pages_saved_from_vllm", pages)

    def _copy_sglang_rows(self, jobs: list[CopyJob], to_vllm: bool) -> None:
        """page_format="sglang": the batch's pages between vLLM's blocks (every layer) and the tier's rows in
        SGLang's layout, one vectorised repack (`SglangPages`)."""
        assert self._sgl is not None
        slots = [s_ for j in jobs for s_ in j.slots]
        ids = [b for j in jobs for b in j.vllm[0]]
        if not ids:
            return
        rows = self._tier[self.rt.model.arena_name]
        if to_vllm:
            self._sgl.from_rows(rows, slots, self._kv, ids)
        else:
            self._sgl.to_rows(self._kv, ids, rows, slots)
        g = self.contract.groups[0].name
        self.rt.count(f"{'pages_loaded' if to_vllm else 'pages_saved'}.{g}", len(ids))
        self.rt.count("pages_loaded_into_vllm" if to_vllm else "pages_saved_from_vllm", len(ids))

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """vLLM calls this at the start of every step, before the forward. A preempted request's save still reading
        its blocks must have run before the forward may overwrite them; and the step's asynchronous loads start here,
        beside the forward (vLLM calls `start_load_kv` only after the forward when no load is synchronous, and
        `get_finished` right after it: a load started there would be reported, and its request scheduled, a step
        later)."""
        meta = kv_connector_metadata
        assert isinstance(meta, KvprocConnectorMetadata)
        self._take_tp_meta(meta)
        if meta.wait_jobs:
            self.rt.count("preemption_waits")
            self._moves.wait(meta.wait_jobs, self.options.move_wait_s)  # else poisoned: reported failed, not sealed
        if meta.flush_jobs and not self._moves.wait(meta.flush_jobs, self.options.move_wait_s):
            self.rt.count("flush_save_waits_timed_out")  # poisoned: reported failed, never committed
        self._start_async_loads(meta)

    def _start_async_loads(self, meta: KvprocConnectorMetadata) -> None:
        if meta.async_started:
            return
        meta.async_started = True
        for job in meta.async_loads:  # one batch a load: each checked (and failed) on its own
            self._moves.submit([job], to_vllm=True)  # vLLM holds these requests back until get_finished
        self._receiving.update(j.req_id for j in meta.async_loads)
        self._receiving.update(meta.unloaded)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvprocConnectorMetadata)
        self._take_tp_meta(meta)
        self._load_errors.update(meta.failed_loads)
        self._failed_recving.update(meta.failed_load_reqs)
        moves = self._moves
        if meta.loads:  # this step's forward reads them: landed (or reported failed) before it starts
            for job in meta.loads:  # one batch a load: each checked (and failed) on its own
                moves.submit([job], to_vllm=True)
            if not moves.wait([j.job_id for j in meta.loads], self.options.move_wait_s):
                self._load_errors.update(b for j in meta.loads for b in j.vllm_blocks())
        self._start_async_loads(meta)  # if handle_preemptions did not (a runner that does not call it)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # the step's synchronous loads landed in start_load_kv; asynchronous ones are not this step's

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # saved in wait_for_save, all layers at once

    def wait_for_save(self) -> None:
        """Submits the step's saves to the mover and returns: their source blocks stay vLLM's request's until they
        settle (a finished request's free is delayed, a preempted one's reuse waits in `handle_preemptions`)."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KvprocConnectorMetadata)
        for job in meta.saves:  # one batch per save: each its own reservation and outcome
            self._moves.submit([job], to_vllm=False)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        moves = self._moves
        self._sending |= moves.delayed_among(finished_req_ids)
        if self._idle_step() and (self._receiving or self._sending):
            # vLLM scheduled nothing: every request it has waits for a load or a delayed free of ours, and its engine
            # loop would call us again at once, hundreds of times per load, holding the GIL and a core the moves
            # need. Wait here (GIL released) until one of them settles, for at most IDLE_WAIT_S: a request vLLM
            # receives meanwhile is seen that much later, and only when the engine had nothing else to do.
            self.rt.count("idle_step_waits")
            moves.wait_any(self._receiving | self._sending, IDLE_WAIT_S)
        recving = moves.settled(self._receiving)
        self._receiving -= recving
        sending = moves.settled(self._sending)
        self._sending -= sending
        return sending or None, recving or None

    def _idle_step(self) -> bool:
        if not self.has_connector_metadata():
            return False
        meta = self._get_connector_metadata()
        return isinstance(meta, KvprocConnectorMetadata) and meta.idle

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """`get_finished`'s sets, plus (a model of several KV cache groups) the requests whose asynchronous load
        failed: vLLM recomputes them. (vLLM refuses failed block ids for several groups: a block id there does not
        name one group's block.)"""
        failed: set[str] = set()
        if self._groups > 1:  # taken first: a load failing meanwhile is reported (failed and received) next time
            failed, self._failed_recving = self._failed_recving | self._moves.take_failed_loads(), set()
        sending, recving = self.get_finished(finished_req_ids)
        return KVConnectorTransferResults(finished_sending=sending or set(),
                                          finished_recving=(recving or set()) | failed, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._load_errors = self._load_errors | self._moves.take_load_errors(), set()
        if self._groups > 1:
            return set()  # reported by request (get_transfer_results)
        self._moves.take_failed_loads()  # reported by block id: the request form is not needed
        return out

    # ============================ scheduler side ============================

    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        self._drain()
        r = self._reqs.get(request.request_id)
        if r is None and _envelope_of(request) is not None:
            r = self._reqs[request.request_id] = _Req(request.request_id, request, retain_s=self._retain_hint(request))
            self._start_handoff(r, _envelope_of(request))
        if r is not None and r.handoff is not None:
            return self._handoff_match(r, num_computed_tokens)
        if r is None:
            tokens = list(request.prompt_token_ids or [])
            if not tokens:  # a prompt of embeddings: no token ids to key pages by; vLLM serves it alone
                self.rt.count("requests_without_token_ids")
                return 0, False
            r = self._reqs[request.request_id] = _Req(request.request_id, request, retain_s=self._retain_hint(request))
            self._start_lookup(r, tokens)
        return self._match(r, num_computed_tokens)

    # ---- P/D consumer ----

    def _start_handoff(self, r: _Req, env: HandoffEnvelope | None) -> None:
        """Refuse a producer whose KV this engine cannot restore (the request is then computed here, in full);
        else lease the producer's padded chain in the tier (`_start_handoff_lookup`)."""
        assert env is not None
        tokens = list(r.request.prompt_token_ids or [])
        try:
            check_fingerprint(self.fingerprint, env.fingerprint)
            if not 0 < env.committed_len < len(tokens):  # vLLM computes at least the last prompt token itself
                raise ValueError(f"the envelope commits {env.committed_len} tokens of a {len(tokens)}-token prompt")
            check_envelope(env, r.req_id, self.store.pools[0].hasher, tokens, _scope(r.request))
        except (FingerprintMismatch, ValueError) as e:
            log.error("kvproc_handoff_refused", req_id=r.req_id, producer_req_id=env.producer_req_id, error=str(e))
            self.rt.count("handoffs_refused")
            if not isinstance(e, ForeignHandleError):  # another prompt's envelope: its own consumer may still read it
                self.store.revoke_handoff(env.producer_req_id)  # nobody will read it
            return
        r.handoff = env
        self._start_handoff_lookup(r, env, tokens)

    def _start_handoff_lookup(self, r: _Req, env: HandoffEnvelope, tokens: list[int]) -> None:
        """Lease the producer's padded chain in the tier (every rank's), waiting for its saves up to `handoff_wait_s`
        (`handoff_direct.full_hit`); the request's own page keys, for the pages it computes."""
        try:
            r.hashes = self._page_keys(r, tokens)
        except (ValueError, TypeError) as e:  # checked by check_envelope already: never here
            log.warning("kvproc_request_refused", req_id=r.req_id, error=repr(e))
            self.rt.count("requests_refused")
            self.store.revoke_handoff(env.producer_req_id)
            r.handoff = None
            return
        r.tracked = True
        keys = handoff_keys(self.hasher, tokens, env.committed_len, _scope(r.request))
        wait = self.options.handoff_wait_s
        assert self.direct is not None
        r.lookup = self.store.submit(full_hit_ranked(self.ranked, r.req_id, keys, wait) if self.ranked is not None
                                     else full_hit(self.direct, r.req_id, keys, wait))

    def _handoff_match(self, r: _Req, num_computed_tokens: int) -> tuple[int | None, bool]:
        """A hand-off: the leased padded chain is loaded straight into vLLM's blocks (the padded page whole: its pad
        rows are overwritten by vLLM before they are read); the lease is released and the producer's hand-off
        consumed once the load settled (`_release_lease`). From the padded page on the request saves its own pages
        (cacheable) like any request."""
        env = r.handoff
        assert env is not None
        if r.lookup is not None:
            hit = self._result(r, r.lookup)
            if hit is _PENDING:
                return None, False
            r.lookup = None
            if hit is None:  # short (evicted, expired, a producer's failed save): vLLM computes the prompt itself
                log.warning("kvproc_handoff_short_hit", req_id=r.req_id, need=-(-env.committed_len // self.page))
                self.rt.count("handoffs_short")
                self.store.revoke_handoff(env.producer_req_id)
                r.handoff = None
                return 0, False
            if isinstance(hit, list):  # tensor parallel: every rank's lease
                r.leases, hit = hit, hit[0]
            r.lease, r.leased_at = hit, time.monotonic()
            r.saved, r.restore_at = env.committed_len // self.page, env.committed_len
            self.rt.count("handoffs_adopted")
            self.rt.count("hit_tokens_host", env.committed_len)
        if r.lease is None or r.job is not None or r.load_job is not None:
            return 0, False
        ext = max(0, env.committed_len - num_computed_tokens)
        if not ext:  # vLLM's own cache has it all: nothing to load, the hand-off is consumed now
            self._release_lease(r)
        r.pending_load = (num_computed_tokens, ext) if ext else None
        return ext, ext > 0 and not self._sync_loads

    # ---- lookups: vLLM's blocks <-> the host tier's slots ----

    def _retain_hint(self, request: "Request") -> float | None:
        """The request's retention hint (`RETAIN_KEY` in its kv_transfer_params): seconds, or None. A bad one is
        logged and ignored (the request is served; only the hint is lost). A P/D producer's takes none: its request
        ends at the prompt, and the consumer's request carries the conversation on (`kvproc proxy` passes the client's
        hint to it)."""
        raw = (getattr(request, "kv_transfer_params", None) or {}).get(RETAIN_KEY)
        if raw is None:
            return None
        try:
            hint = check_retain_s(raw, SaveClass.CACHEABLE)
        except (TypeError, ValueError) as e:
            log.warning("kvproc_retain_hint_refused", req_id=request.request_id, error=str(e))
            self.rt.count("retain_hints_refused")
            return None
        if hint is not None and self.producer:
            self.rt.count("retain_hints_ignored")
            return None
        return hint

    def _start_lookup(self, r: _Req, tokens: list[int]) -> None:
        """Hash the prompt's pages under kvproc's chain and lease the longest prefix the tier holds (at most one
        token short of the prompt: vLLM computes the last one itself)."""
        try:
            r.hashes = self._page_keys(r, tokens)
        except (ValueError, TypeError) as e:  # tokens kvproc cannot key (an id past its range): vLLM serves it alone
            log.warning("kvproc_request_refused", req_id=r.req_id, error=repr(e))
            self.rt.count("requests_refused")
            return
        r.tracked = True
        cap = (len(tokens) - 1) // self.page
        if cap > 0:
            assert self.direct is not None
            r.lookup = self.ranked.lookup(r.req_id, r.hashes[:cap]) if self.ranked is not None \
                else self.direct.lookup(r.req_id, r.hashes[:cap])

    def _result(self, r: _Req, fut: concurrent.futures.Future[Any]) -> Any:
        """A resolve's or lookup's result, or `_PENDING` (vLLM asks again at its next step). The first ask waits a
        little (most finish in well under a millisecond), later ones not at all: a slow one (the tier answered
        Loading) must never hold up vLLM's scheduler step after step. One that raised (a bug: a degrade is a
        result) is a miss (None)."""
        first, r.asked = not r.asked, True
        try:
            return fut.result(timeout=self.options.resolve_wait_s if first else 0)
        except concurrent.futures.TimeoutError:
            self.rt.count("resolve_asked_again")
            return _PENDING
        except Exception as e:  # noqa: BLE001
            log.error("kvproc_resolve_failed", req_id=r.req_id, error=repr(e))
            return None

    def _match(self, r: _Req, num_computed_tokens: int) -> tuple[int | None, bool]:
        if r.lookup is not None:
            hit = self._result(r, r.lookup)
            if hit is _PENDING:
                return None, False
            r.lookup = None
            if isinstance(hit, list):  # tensor parallel: every rank's lease, all of the common prefix
                r.leases, hit = hit, hit[0]
            if isinstance(hit, Hit):
                # A P/D producer's hand-off names every page of the prompt, those the tier has (pinned, not copied)
                # included: it saves from page 0, and keeps the lease until that save settled (`_save_done`).
                r.lease, r.saved, r.restore_at = hit, 0 if self.producer else hit.pages, hit.pages * self.page
                r.leased_at = time.monotonic()
                self.rt.count("hit_tokens_host", r.restore_at)
        if not r.tracked or r.job is not None or r.load_job is not None or r.lease is None:
            return 0, False
        ext = max(0, r.restore_at - num_computed_tokens)
        if not ext and not self.producer:  # vLLM's own cache has the prefix (or more): the leased slots are not needed
            self._release_lease(r)
        r.pending_load = (num_computed_tokens, ext) if ext else None
        # asynchronous: vLLM holds the request back until the mover reports the load (sync: the load lands before
        # this request's first forward)
        return ext, ext > 0 and not self._sync_loads

    def _release_lease(self, r: _Req) -> None:
        held = r.lease is not None
        if r.leases and self.ranked is not None:
            self.ranked.release(r.leases)
        elif r.lease is not None and self.direct is not None:
            self.direct.release(r.lease.lease_id)
        r.lease, r.leases = None, []
        if held and r.handoff is not None:  # a direct hand-off's load settled (or was not needed): consumed
            self.store.release_handoff(r.handoff.producer_req_id)

    def _extend_hashes(self, r: _Req, pages: int, known: Any) -> bool:
        """The request's page hashes up to `pages` (decode fills pages past the prompt's): False where a page's tokens
        are not all known yet, or cannot be keyed."""
        have = len(r.hashes)
        if pages <= have:
            return True
        new = list(known[have * self.page:pages * self.page])
        if len(new) < (pages - have) * self.page or min(new) < 0:  # a placeholder of a token not sampled yet
            return False
        try:
            r.hashes += self._page_keys(r, new)
        except (ValueError, TypeError):
            return False
        return len(r.hashes) >= pages

    def _page_keys(self, r: _Req, tokens: Sequence[int]) -> list[bytes]:
        """The tier keys of the full pages of `tokens`, which follow the request's pages keyed so far: kvproc's hash
        chain, or (page_format="sglang") SGLang's page keys in the SGLang backend's namespace, vLLM's cache_salt as
        SGLang's. ValueError where the request cannot be keyed (vLLM then serves it alone)."""
        scope = _scope(r.request)
        if self._sgl_keys is None:
            return list(self.hasher.hash_prompt(tokens, scope, parent=r.hashes[-1] if r.hashes else None))
        if scope.lora_name:
            raise ValueError("page_format='sglang': a LoRA adapter's pages have no SGLang key here")
        return self._sgl_keys.extend(r.chain, tokens, scope.cache_salt or None)

    def _table_pages(self, r: _Req) -> int:
        """Pages every paged group's vLLM block table covers (a state group's table is not a page table)."""
        return min((len(ids) for g, ids in zip(self.contract.groups, r.vllm_blocks) if not g.state), default=0)

    def _pages_of(self, r: _Req, a: int, b: int) -> tuple[list[int], ...]:
        """vLLM's blocks of pages a..b in each group (NULL_BLOCK where a sliding window gave one back; a state group:
        none, its one block per hit travels as a `CopyJob.states` entry)."""
        return tuple([] if g.state else ids[a:b] for g, ids in zip(self.contract.groups, r.vllm_blocks))

    def _save_source(self, r: _Req, have: int, target: int) -> tuple[list[int], ...] | None:
        """The blocks a save of pages have..target reads; None (and the request saves no more) where vLLM no longer
        keeps one of them: a sliding window passed it before its save could be planned, and the chain cannot continue
        past the hole."""
        vllm = self._pages_of(r, have, target)
        # A P/D producer's pages under its lease are in the tier (the hand-off pins them, nothing copied): a sliding
        # window may have given their blocks back. (A slot reserved for one anyway is refused: `_write_save`.)
        leased = r.lease.pages - have if self.producer and r.lease is not None else 0
        if any(NULL_BLOCK in ids[max(0, leased):] for ids in vllm):
            self.rt.count("saves_window_passed")
            r.saving = False
            return None
        return vllm

    def _plan_save(self, r: _Req, computed_after: int, meta: KvprocConnectorMetadata,
                          after: CopyJob | None = None) -> None:
        """Pages that are full once this step ran, from the tier's end of the request on: their keys now, their slots
        from the tier on the mover thread after the forward (`_copy`). `after`: this step's synchronous load of the
        request (the save runs only if it succeeded); a load of another step still in flight defers the save."""
        loading = r.load_job is not None and (after is None or after.job_id != r.load_job)
        if not r.saving or r.job is not None or r.finishing or loading or r.padded:
            return
        have = r.saved
        target = min(computed_after // self.page, self._table_pages(r))
        prompt = r.request.num_prompt_tokens
        # (state groups: no padded page, the hand-off ends at its deepest checkpoint: `r.checkpoint_at`)
        tail = self.producer and not self.contract.states and computed_after >= prompt and \
            -(-prompt // self.page) <= self._table_pages(r)
        if self.producer:  # a hand-off is the prompt's KV, its partial last page padded; nothing decoded
            target = min(target, prompt // self.page)
        if (target <= have and not tail) or not self._extend_hashes(r, target, r.request.all_token_ids):
            return
        vllm = self._save_source(r, have, target)
        if vllm is None:
            return
        assert self.direct is not None
        tokens = list(r.request.all_token_ids[have * self.page:target * self.page]) \
            if self.direct.tier.wants_token_ids else None  # the tier's KV events carry them
        keys = r.hashes[have:target]
        if tail:
            r.padded = True  # the hand-off's last page is planned: the producer saves nothing more
            if prompt % self.page:
                part = list(r.request.all_token_ids[target * self.page:prompt])
                keys = keys + [padded_tail_key(self.hasher, part, _scope(r.request), r.hashes[target - 1]
                                               if target else None)]
                vllm = tuple(ids + extra for ids, extra in zip(vllm, self._pages_of(r, target, target + 1)))
                if tokens is not None:
                    tokens += part + [PAD_TOKEN_ID] * (self.page - len(part))
            if not keys:
                return
        job = CopyJob(next(self._job_ids), r.req_id, [], vllm, keys=keys,
                      parent=r.hashes[have - 1] if have else None, tokens=tokens, after=after)
        if self.ranked is not None:  # tensor parallel: every rank's slots now, written by each rank after the forward
            if self.contract.states:
                self._with_offered_state(r, target, job)
            saves = self.ranked.reserve(job.job_id, r.req_id, job.keys, job.parent, tokens,
                                        save_class=self._save_class, bounded_groups=job.bounded)
            if saves is None:
                self.rt.count("saves_refused")
                r.saving = False
                return
            job.rank_saves = saves
        r.job, r.save_to = job.job_id, have + len(job.keys)
        self._jobs[job.job_id] = r
        meta.saves.append(job)

    def _with_offered_state(self, r: _Req, target: int, job: CopyJob) -> None:
        """Tensor parallel: the checkpoint at the save's last page, where vLLM offered this step the states its
        forward writes there (each rank copies its shard after the forward, before the next one can reuse the
        block). An offer elsewhere is not saved: the chain's checkpoints are where the tier's pages end."""
        entries = self._offers.get(r.req_id, ())
        states = [(gi, -1, b) for gi, b, n in entries if n == target * self.page and b != NULL_BLOCK]
        if len(states) == len(self.contract.states):
            job.states, job.bounded = states, [g.name for g in self.contract.states]
            if self.producer:  # the hand-off ends there (its save reported by every rank later: a short hit if not)
                r.checkpoint_at = max(r.checkpoint_at, target * self.page)
        elif entries:
            self.rt.count("state_offers_missed", len(entries))

    def _state_loads(self, r: _Req, end_page: int) -> list[tuple[int, int, int]] | None:
        """Each state group's checkpoint at the hit into the vLLM block vLLM reads the state from (the group's block
        at index end_page - 1: block i holds the state after i + 1 pages). None when the load cannot be whole: the
        hit is not where the checkpoint is, or vLLM gave no block there."""
        if end_page * self.page != r.restore_at or r.lease is None:
            return None
        slots = r.lease.bounded_slots  # the tier's slots of the checkpoint at the hit
        out = []
        for g in self.contract.states:
            ids = r.vllm_blocks[g.index]
            if g.name not in slots or len(ids) < end_page or ids[end_page - 1] == NULL_BLOCK:
                return None
            out.append((g.index, slots[g.name], ids[end_page - 1]))
        return out

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        r = self._reqs.get(request.request_id)
        if r is None:
            return
        r.vllm_blocks = [list(g) for g in blocks.get_block_ids()]
        if num_external_tokens == 0:
            r.pending_load = None
        elif r.pending_load is not None and r.pending_load[1] != num_external_tokens:
            # vLLM trimmed the external hit (a partial local block): load what it kept, from the same start
            r.pending_load = (r.pending_load[0] + r.pending_load[1] - num_external_tokens, num_external_tokens)
        if r.pending_load is not None and r.tracked and not self._sync_loads:
            self._async_ready.append(r)  # vLLM holds it back for the load: planned in this step's meta

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        if (self.contract.has_sliding or self.contract.states) and self._jobs and self.rt.moves is not None:
            # vLLM freed the requests' blocks that slid out of their windows in this step's scheduling, and this
            # step's forward may overwrite them: the saves still reading them (last step's) land first, and a save
            # is planned only over blocks vLLM still keeps (below). State groups: the pages a state offered now
            # closes must be in the tier before its checkpoint is saved there. Usually done already.
            if not self.rt.moves.wait(list(self._jobs), self.options.move_wait_s):
                self.rt.count("flush_save_waits_timed_out")  # poisoned: reported failed, never sealed
        self._drain()
        meta = KvprocConnectorMetadata()
        ready, self._async_ready = self._async_ready, []
        for held in ready:
            if held.pending_load is not None and not held.finishing and held.tracked:
                self._plan_load(held, meta, meta.async_loads)
        for req_id in scheduler_output.preempted_req_ids or ():
            pre = self._reqs.get(req_id)
            if pre is not None and pre.job is not None:  # vLLM reuses its blocks in this very step
                meta.wait_jobs.append(pre.job)
        computed: dict[str, int] = {}
        # vLLM's live block tables (the blocks a sliding window gave back read as NULL_BLOCK), where this vLLM offers
        # them; else the tables rebuilt from the step's diffs (full attention only: blocks are never given back
        # while a request runs).
        live = getattr(scheduler_output, "kv_connector_block_state", None)
        for new in scheduler_output.scheduled_new_reqs:
            r = self._reqs.get(new.req_id)
            if r is not None:
                r.vllm_blocks = [list(g) for g in new.block_ids]
                computed[new.req_id] = new.num_computed_tokens
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            r = self._reqs.get(req_id)
            if r is None:
                continue
            ids = cached.new_block_ids[i]
            if req_id in cached.resumed_req_ids:
                r.vllm_blocks = [list(g) for g in ids] if ids is not None else []
            elif ids is not None:
                if len(r.vllm_blocks) != len(ids):
                    r.vllm_blocks = [[] for _ in ids]
                for mine, more in zip(r.vllm_blocks, ids):
                    mine.extend(more)
            computed[req_id] = cached.num_computed_tokens[i]
        if live is not None:
            for req_id in computed:
                ids = live.get_block_ids(req_id)
                if ids is not None:
                    self._reqs[req_id].vllm_blocks = [list(g) for g in ids]
            if self.contract.states and self.ranked is not None:
                # Tensor parallel: only a rank's process can read its state shard, so this step's offers (states its
                # forward writes) are saved with the pages they close, by each rank after the forward
                # (`_plan_direct_save`).
                self._offers = dict(live.boundary_state_offloads or {})
            elif self.contract.states:
                # Last step's offers: their states were written by its forward and are still in their blocks (this
                # step's forward has not run), and the pages they close have landed in the tier (flushed above).
                offers, self._offers = self._offers, dict(live.boundary_state_offloads or {})
                if not self._async_scheduling:
                    self._offer_prompt_ends(offers, computed)
                self._save_offered_states(offers)
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            r = self._reqs.get(req_id)
            if r is None or not r.tracked or req_id not in computed:
                continue
            load = None  # this step's synchronous load of the request: a save planned now runs only if it succeeded
            if r.pending_load is not None:  # synchronous loads: landed before the forward
                self._plan_load(r, meta, meta.loads)
                load = meta.loads[-1] if meta.loads and meta.loads[-1].job_id == r.load_job else None
            self._plan_save(r, computed[req_id] + n, meta, after=load)
        meta.idle = scheduler_output.total_num_scheduled_tokens == 0
        if self.ranked is not None:
            if self.ranked.follow_replaced():  # a rank's tier replaced and re-attached: the workers map the new one
                self._tier_attach = self.ranked.attach
                self.rt.count("tier_remapped")
                log.warning("kvproc_tier_remapped", segments=self._tier_attach.segments,
                            epochs=self._tier_attach.epochs)
            meta.tiers = self._tier_attach
            meta.delayed, self._delayed_next = self._delayed_next, []
            if self.contract.has_sliding or self.contract.states:
                # The wait above, in the ranks' processes (their movers run the saves): vLLM freed the blocks that
                # slid out of a window in this step's scheduling, and may give an offered state's block to another
                # request: a save planned last step may still read one.
                meta.flush_jobs = list(self._jobs)
        return meta

    def _offer_prompt_ends(self, offers: dict[str, list[tuple[int, int, int]]], computed: dict[str, int]) -> None:
        """The state at the end of a prompt of whole pages, added to last step's offers: vLLM never offers it (its
        checkpoint position leaves one token of a prompt to recompute: `get_mamba_prefill_checkpoint_position`, so
        `cache_blocks` hashes nothing past page (prompt - 1) // page), and without it the next turn's hit stops a
        page short. It is where align mode keeps a request's latest state: computed up to exactly the prompt's end,
        the state group's block at index prompt / page - 1 (block i: the state after i + 1 pages; vLLM's
        `preprocess_mamba` copies this step's starting state from there), written by last step's forward (its saves,
        waited for above, ran after it) and only read by this step's, which has not run.
        So it holds exactly the state after the boundary's last token; a request not scheduled right after its last
        prefill chunk (finished, preempted) is not offered it: a shorter hit, never a wrong state. Sync scheduling
        only: under async scheduling last step's forward may still be running when this step is planned."""
        for req_id, done in computed.items():
            r = self._reqs.get(req_id)
            if r is None or not done or done % self.page or done != r.request.num_prompt_tokens or \
                    any(n == done for _, _, n in offers.get(req_id, ())):
                continue
            at = done // self.page - 1
            entries = [(g.index, ids[at], done) for g in self.contract.states
                       if g.index < len(r.vllm_blocks) and at < len(ids := r.vllm_blocks[g.index])
                       and ids[at] != NULL_BLOCK]
            if len(entries) == len(self.contract.states):
                offers.setdefault(req_id, []).extend(entries)
                self.rt.count("state_prompt_ends_offered")

    def _save_offered_states(self, offers: dict[str, list[tuple[int, int, int]]]) -> None:
        """The states vLLM offered at the last step (`boundary_state_offloads`: vLLM group, block, boundary tokens),
        which that step's forward wrote: vLLM offers a state in the scheduling pass of the step that computes it,
        and may give its block to another request from the next pass on, whose forward overwrites it. So each one
        where the tier has the request's pages up to it is saved now, before this step's forward (the pages' save
        was waited for first), as a save of the boundary's key with the state groups' artifacts (the page itself is
        there already: nothing copied for it)."""
        moves = self.rt.moves
        if moves is None:
            return
        for req_id, entries in offers.items():
            r = self._reqs.get(req_id)
            if r is None or not r.tracked or not r.saving or r.finishing or r.job is not None:
                continue
            boundary = r.saved * self.page
            states = [(gi, -1, b) for gi, b, n in entries if n == boundary and b != NULL_BLOCK]
            if not boundary or len(states) != len(self.contract.states):
                self.rt.count("state_offers_missed", len(entries))  # not where the tier's copy ends: not saved
                continue
            job = CopyJob(next(self._job_ids), r.req_id, [], tuple([] for _ in self.contract.groups), states,
                          keys=[r.hashes[r.saved - 1]], bounded=[g.name for g in self.contract.states])
            moves.submit([job], to_vllm=False)
            moves.wait([job.job_id], self.options.move_wait_s)  # past it: poisoned, reported failed
            ok = bool(moves.take_outcome(job.job_id))
            self.rt.count("state_checkpoints_sealed" if ok else "state_checkpoints_failed")
            if ok and self.producer:  # the hand-off ends there (a HANDOFF save: pinned for the consumer)
                r.checkpoint_at = max(r.checkpoint_at, boundary)

    def _plan_load(self, r: _Req, meta: KvprocConnectorMetadata, into: list[CopyJob]) -> None:
        assert r.tracked and r.pending_load is not None and r.lease is not None
        local, ext = r.pending_load
        r.pending_load = None
        a, b = local // self.page, (local + ext) // self.page
        if r.handoff is not None:  # the padded page too, whole: its pad rows are overwritten before they are read
            b = -(-(local + ext) // self.page)
        if self._load_job(r, list(r.lease.page_slots), a, b, meta, into):
            self.rt.count("hit_tokens_loaded", ext)
            if r.handoff is not None:
                self.rt.count("handoff_tokens_loaded", ext)
            if into is meta.async_loads:
                self.rt.count("loads_async")

    def _load_job(self, r: _Req, slots: list[int], a: int, b: int, meta: KvprocConnectorMetadata,
                  into: list[CopyJob]) -> bool:
        """Pages a..b of the leased `slots` into vLLM's blocks of every group.
        False (and the load reported failed: vLLM recomputes it) when vLLM's tables do not cover them: a full-attention
        group must have a block for every page; a sliding-window group's NULL_BLOCK pages are out of its window."""
        vllm = list(self._pages_of(r, a, b))
        short = b > len(slots) or len(vllm) != self._groups or any(
            len(ids) != b - a for g, ids in zip(self.contract.groups, vllm) if not g.state) or any(
            NULL_BLOCK in ids for g, ids in zip(self.contract.groups, vllm) if not g.sliding)
        states = self._state_loads(r, b) if self.contract.states else []
        short = short or states is None
        if short:
            # Never: vLLM counted these tokens as computed, so they must be recomputed, not left unloaded.
            log.error("kvproc_load_inconsistent", req_id=r.req_id, pages=(a, b), slots=len(slots),
                      vllm=[len(g) for g in r.vllm_blocks])
            if self._groups > 1:
                meta.failed_load_reqs.append(r.req_id)
            else:
                meta.failed_loads.extend(b_ for ids in vllm for b_ in ids if b_ != NULL_BLOCK)
            if into is meta.async_loads:  # vLLM holds it back: report it (its blocks failed) at once
                meta.unloaded.append(r.req_id)
            return False
        job = CopyJob(next(self._job_ids), r.req_id, slots[a:b], tuple(vllm), states or [])
        assert r.lease is not None  # checked after the copy (`HostDirect.intact`)
        job.gens = list(r.lease.page_gens[a:b]) if r.lease.page_gens else []
        job.leased_at, job.epoch = r.leased_at, r.lease.epoch
        if self.ranked is not None:  # tensor parallel: each rank copies its own tier's slots
            job.rank_slots = [list(h.page_slots[a:b]) for h in r.leases]
            job.rank_gens = [list(h.page_gens[a:b]) for h in r.leases]
            job.rank_epochs = [h.epoch for h in r.leases]
            names = {g.index: g.name for g in self.contract.states}
            job.rank_states = [[(gi, h.bounded_slots[names[gi]], blk) for gi, _, blk in job.states]
                               for h in r.leases]
            self.ranked.expect_load(job.job_id)
        self._loads[job.job_id] = r
        r.load_job = job.job_id
        into.append(job)
        return True

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self.ranked is not None:
            self.ranked.report(connector_output.kv_connector_worker_meta)
        self._drain()

    def _drain(self) -> None:
        """The mover's settled jobs (`moves.py`; tensor parallel: those every rank reported, `tp.py`), on the
        scheduler's thread: seal saved pages, unpin loaded ones."""
        if self.ranked is not None:
            settled = self.ranked.settled()
        elif self.rt.moves is not None:
            settled = self.rt.moves.drain()
        else:
            return
        for job_id, ok in settled:
            r = self._loads.pop(job_id, None)
            if r is not None:
                self._load_done(r, job_id, ok)
                continue
            r = self._jobs.pop(job_id, None)
            if r is not None and r.job == job_id:  # else a save of a request already retired
                self._save_done(r, ok)

    def _load_done(self, r: _Req, job_id: int, ok: bool = True) -> None:
        """vLLM's blocks have the pages (or, failed, vLLM recomputes them): the source need not stay pinned."""
        if r.load_job != job_id:
            return
        r.load_job = None
        if r.lease is not None:  # the one copy of the hit is in vLLM's blocks
            self.store.outcomes.record("load", r.req_id, "ok" if ok else "failed")
            if not self.producer:  # a producer's lease keeps the hit's pages until its hand-off save pinned them
                self._release_lease(r)
        if r.finishing and r.job is None:
            self._retire(r)

    def _save_done(self, r: _Req, ok: bool) -> None:
        """The tier committed the save's pages, or it failed (the outcome is recorded by `HostDirect.save`)."""
        r.job = None
        if ok:
            r.saved = max(r.saved, r.save_to)
        else:
            r.saving = False
            if self.producer:  # undelivered: its consumer will see a short hit
                self.rt.count("handoff_save_failed")
                log.error("handoff save failed", req_id=r.req_id, pages=r.save_to - r.saved,
                          reason="the save's outcome (HostDirect)")
        if self.producer:  # the hit's pages are pinned by the hand-off's commit now (or it failed)
            self._release_lease(r)
        if r.finishing and r.retain_s is not None:  # its last save settled: the hint now (`_retain`)
            self._retain(r)
        if r.finishing and r.load_job is None:
            self._retire(r)

    def _retain(self, r: _Req) -> None:
        """A finished request's retention hint, once its saves settled (`request_finished`, or `_save_done` of its
        last one): the tier re-ranks the prefix of the request's pages it holds, on every rank's tier
        (`HostDirect.retain`, on the store's loop). Nothing is copied, so vLLM frees the request's blocks as if it had
        no hint: an earlier form saved the pages again from vLLM's blocks and held them a step longer, which cost a
        block-bound engine (Gemma 3's two groups) a step of every next request's admission (bench/RESULTS.md)."""
        hint, r.retain_s = r.retain_s, None
        if hint is None or r.saved <= 0 or len(r.hashes) < r.saved:  # (a failed save's earlier pages: still hinted)
            return
        directs = list(self.ranked.directs) if self.ranked is not None else [self.direct] if self.direct else []
        if not directs:
            return
        self.rt.count("retain_hint_saves")
        self.store.submit(self._retain_on_tiers(directs, r.req_id, r.hashes[:r.saved], hint))

    async def _retain_on_tiers(self, directs: list["HostDirect"], req_id: str, keys: list[bytes], hint: float) -> None:
        try:
            reached = await asyncio.gather(*(d.retain(req_id, keys, hint) for d in directs))
        except Exception as e:  # noqa: BLE001 - a lost hint, never the engine's failure (each tier's outcome recorded)
            log.warning("kvproc_retain_hint_failed", req_id=req_id, error=repr(e))
            reached = [0]
        self.rt.count("retain_hint_saves_ok" if min(reached) == len(keys) else
                      "retain_hint_saves_short" if min(reached) else "retain_hint_saves_failed")

    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's call for a `SupportsHMA` connector (every model, one group or several): the blocks are not read."""
        return self.request_finished(request, [])

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._drain()
        r = self._reqs.get(request.request_id)
        if r is None:
            return False, None
        r.finishing = True
        params = self._envelope_out(r, request) if self.producer else None
        if r.job is None:  # else its hint waits for its last save's commit (`_save_done`)
            self._retain(r)
        # A save still reading vLLM's blocks: vLLM keeps them until the worker reports it settled (get_finished).
        # (A load in flight needs nothing from us: vLLM keeps a request's blocks while it waits for a load.)
        saving = r.job is not None
        delay = saving and (self.rt.moves is not None or self.ranked is not None)
        if delay:
            if self.ranked is not None:
                self._delayed_next.append(r.req_id)  # each rank's worker hears it with the next step
            else:
                assert self.rt.moves is not None
                self.rt.moves.delay_free(r.req_id)
            self.rt.count("frees_delayed")
        if r.job is None and r.load_job is None:
            self._retire(r)
        return delay, params

    def _envelope_out(self, r: _Req, request: "Request") -> dict[str, Any] | None:
        """The producer's hand-off envelope as vLLM's kv_transfer_params: the prompt's KV (its save in flight or
        done: the consumer's full-hit lookup waits for it), the anchor = the first sampled token. A model with state
        groups hands off up to its deepest checkpoint (a page boundary: vLLM keeps no state inside a page); the
        consumer computes the prompt's tail beyond it."""
        prompt = request.num_prompt_tokens
        committed = r.checkpoint_at if self.contract.states else prompt
        saved = r.padded or bool(self.contract.states)  # every page's save planned (state groups: a checkpoint)
        if not saved or not r.saving or request.num_computed_tokens < prompt or committed <= 0:
            self.rt.count("handoffs_not_made")  # not saved (a refusal, a failed save) or aborted mid-prefill
            if r.tracked:  # its HANDOFF saves so far (and those in flight) pin nothing
                self.store.revoke_handoff(r.req_id)
            return None
        out = request.output_token_ids
        env = HandoffEnvelope(r.req_id, self.fingerprint, committed_len=committed,
                              anchor_token_id=int(out[0]) if out else None,
                              chain_key=chain_key(self.store.pools[0].hasher, list(request.prompt_token_ids or []),
                                                  committed, _scope(request)))
        self.rt.count("handoffs_made")
        return {HANDOFF_KEY: msgspec.to_builtins(env)}

    @property
    def _save_class(self) -> SaveClass:
        return SaveClass.HANDOFF if self.producer else SaveClass.CACHEABLE

    def _retire(self, r: _Req) -> None:
        self._reqs.pop(r.req_id, None)
        if r.lookup is not None:  # finished (aborted) while its lookup ran: release the lease when it lands
            r.lookup.add_done_callback(self._release_late_lease)
            r.lookup = None
            if r.handoff is not None:  # nobody will read this hand-off now
                self.store.revoke_handoff(r.handoff.producer_req_id)
        self._release_lease(r)

    def _release_late_lease(self, fut: concurrent.futures.Future[Hit | None]) -> None:
        try:
            hit = fut.result()
        except Exception:  # noqa: BLE001 - nothing leased
            return
        if isinstance(hit, list) and self.ranked is not None:
            self.ranked.release(hit)
        elif hit is not None and self.direct is not None:
            self.direct.release(hit.lease_id)

    # ============================ both ============================

    def take_events(self) -> list[Any]:
        """The host tier's KV events since the last call, as vLLM's (`event_forward.py`); vLLM's scheduler publishes
        them with its own at each step. Nothing unless `kv_events` and vLLM's own KV events are both on."""
        return self._events.take() if self._events is not None else []

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._events is not None:
            log.info("kv_event_forward_closed", **self._events.stats())
            self._events.close()
        moves = self.rt.moves
        if self._reqs and moves is not None:  # the scheduler side: the last saves land and are sealed first
            if not moves.idle(self.options.move_wait_s):
                log.error("kvproc_moves_not_settled_at_shutdown", requests=len(self._reqs))
            self._drain()
        for r in list(self._reqs.values()):
            self._release_lease(r)
        self._reqs.clear()
        # Views of the tier's segment (direct) that the runtime unmaps when the last half goes: dropped only once no
        # move still reads them (this may be the worker's half, which has no requests and did not wait above).
        if moves is not None and moves.idle(self.options.move_wait_s):
            self._tier.clear()
            self._kv.clear()
        if self._tp_worker:  # its moves ended above (or never will): the mapping goes with them
            if moves is not None:
                moves.close()
            if self._tier_slots is not None:
                self._tier_slots.close()
            return
        if self.ranked is not None:
            self.ranked.close()  # saves no rank reports any more: slots given back now, not at the tier's TTL
        rt_mod.release(self.rt)


def _new_pages(job: CopyJob, slots: Sequence[int | None], states: list[tuple[int, int, int]] | None = None) -> CopyJob:
    """The part of a save `job` its reserved `slots` ask for (None: the tier has that page already), as rows to copy:
    one rank's (tensor parallel) or the one tier's."""
    keep = [i for i, slot in enumerate(slots) if slot is not None]
    return CopyJob(job.job_id, job.req_id, [slots[i] for i in keep],  # type: ignore[misc]
                   tuple([ids[i] for i in keep] if ids else [] for ids in job.vllm), states or [])


def _envelope_of(request: "Request") -> HandoffEnvelope | None:
    """The hand-off envelope a P/D consumer's request carries (None: an ordinary request)."""
    raw = (getattr(request, "kv_transfer_params", None) or {}).get(HANDOFF_KEY)
    if raw is None:
        return None
    try:
        return msgspec.convert(raw, HandoffEnvelope)
    except msgspec.ValidationError as e:
        log.error("kvproc_handoff_envelope_invalid", req_id=request.request_id, error=str(e))
        return None


__all__ = ["CopyJob", "KvprocConnector", "KvprocConnectorMetadata"]

