"""The kvproc side of one vLLM engine: a `ClusterStore` (host tier + copy worker processes) the engine maps.

Pages move between vLLM's blocks and the host tier's slots in one copy each way (`kvproc/store/host_direct.py`: the
engine maps the tier's segment; a lookup leases the slots, a save reserves them and holds their fence while it
writes), on the engine's mover thread (`moves.py`). vLLM owns its KV tensors and block table; the store attached here
has a model of vLLM's layout (`_VllmLayout`: one arena per vLLM layer, one block each) only so that the tier learns
the pages' shape; it caches nothing itself.

vLLM creates the worker-side connector first (it owns the tensors) and the scheduler side later, in the same
process for a one-rank engine: both look the runtime up here by the engine's id, and the last one to shut down
closes it (an `atexit` hook closes any left open).
"""

from __future__ import annotations

import atexit
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import structlog

from kvproc import ArenaId, ClusterStore, KvArena, KvSpec, KvStore, RepackDirection, StoreConfig
from kvproc.integrations.vllm.contract import VllmKvContract
from kvproc.integrations.vllm.moves import MoveQueue
from kvproc.runtime import manifest as mf
from kvproc.runtime.event_interval import DEFAULT_INTERVAL_S, MAX_INTERVAL_S, check_interval
from kvproc.store.host_direct import HostDirect

if TYPE_CHECKING:
    import torch

log = structlog.get_logger("kvproc.integrations.vllm")

_lock = threading.Lock()
_runtimes: dict[str, "KvprocRuntime"] = {}


@dataclass(frozen=True)
class RuntimeOptions:
    """The connector's settings (`kv_connector_extra_config`, all optional)."""

    host_bytes: int = 1 << 30  # the host tier's budget
    model_id: str | None = None  # the weights' identity (default: from vLLM's model config)
    resolve_wait_s: float = 0.05  # a resolve not done by then is asked again at vLLM's next step
    log_level: str = "warning"  # kvproc's processes
    # A shared host tier's runtime dir (`kvproc up --runtime-dir DIR`): the engine attaches to it instead of starting
    # its own. P/D needs one: the producer's and the consumer's stores must reach the same tier.
    tier_runtime_dir: str | None = None
    handoff_wait_s: float = 15.0  # a P/D consumer's full-hit resolve waits this long for the producer's saves
    # When a hit's bytes land in vLLM's blocks (`moves.py` copies them, off vLLM's forward thread either way).
    # "sync": before the step's forward that first reads them (the request runs in the step it is scheduled in);
    # "async": beside a forward, the request held back until `get_finished` reports the load (one engine step
    # later). "auto": sync where vLLM can hear of a failed synchronous load (a model of one KV cache group, one rank:
    # its failed blocks are recomputed), async otherwise. Saves are never waited for (a finished request's free is
    # delayed until they settle).
    loads: str = "auto"
    move_wait_s: float = 60.0  # the longest anything waits for a move (a preempted request's save, a sync load)
    # KV events of the host tier (medium "CPU", kvproc's page hashes; docs/observability.md) for KV-aware routers:
    # the tier this engine starts publishes them; an attached shared tier (`tier_runtime_dir`) must have been
    # started with `kvproc up --kv-events` (and `--kv-events-tokens` for `kv_events_tokens`), checked at start. vLLM's
    # own GPU blocks are vLLM's `kv_events_config`.
    kv_events: bool = False
    kv_events_interval_ms: float | None = None  # the batch interval (default 50); a shared tier's is its own
    kv_events_tokens: bool = False  # BlockStored carry the pages' token ids (each save sends its tokens)
    # The host tier's events also go out in vLLM's own stream (`event_forward.py`), when vLLM's KV events are on
    # (`--kv-events-config`: enable_kv_cache_events): a router reading vLLM's endpoint then sees both tiers. Opt-in:
    # they carry kvproc's page hashes, not vLLM's (a router that matches prompts by token ids wants kv_events_tokens).
    kv_events_into_vllm: bool = False
    # What vLLM does with a request whose kvproc load failed (a lease lost, a stalled tier, a dead copy worker):
    # "recompute" (the connector sets vLLM's kv_load_failure_policy so: the request's tokens are computed, a slower
    # step, never a failed request) or "vllm" (vLLM's own setting stands; its default, "fail", ends the request with
    # an error).
    load_failure_policy: str = "recompute"
    # How pages are keyed and laid out in the host tier. "vllm": kvproc's hash of the token ids, one arena per layer
    # in vLLM's block layout. "sglang": as kvproc's SGLang HiCache backend stores them (SGLang's page keys, one row
    # per page in SGLang's host layout `sglang_layout`), so that an SGLang engine with the same model_id on the same
    # tier hits the pages this engine computed and the reverse (`sglang_format.py`, docs/sglang.md).
    page_format: str = "vllm"
    sglang_layout: str = "page_first"  # SGLang's --hicache-mem-layout, with page_format="sglang"

    def __post_init__(self) -> None:
        if self.loads not in ("auto", "sync", "async"):
            raise ValueError(f"kv_connector_extra_config: loads must be 'auto', 'sync' or 'async', got {self.loads!r}")
        if self.load_failure_policy not in ("recompute", "vllm"):
            raise ValueError("kv_connector_extra_config: load_failure_policy must be 'recompute' or 'vllm', got "
                             f"{self.load_failure_policy!r}")
        if self.page_format not in ("vllm", "sglang"):
            raise ValueError(f"kv_connector_extra_config: page_format must be 'vllm' or 'sglang', got "
                             f"{self.page_format!r}")
        if (self.kv_events_tokens or self.kv_events_interval_ms is not None or self.kv_events_into_vllm) and \
                not self.kv_events:
            raise ValueError("kv_connector_extra_config: kv_events_tokens / kv_events_interval_ms / kv_events_into_vllm "
                             "need kv_events")
        if self.kv_events_interval_ms is not None:
            if self.tier_runtime_dir is not None:
                raise ValueError("kv_connector_extra_config: kv_events_interval_ms is the shared tier's setting "
                                 "(`kvproc up --kv-events-interval-ms`), not an attached engine's")
            try:
                check_interval(self.kv_events_interval_ms / 1000)
            except (TypeError, ValueError):
                raise ValueError(f"kv_connector_extra_config: kv_events_interval_ms must be > 0 and <= "
                                 f"{MAX_INTERVAL_S * 1000:g}, got {self.kv_events_interval_ms!r}") from None

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> "RuntimeOptions":
        extra = dict(extra or {})
        known = {f for f in cls.__dataclass_fields__}
        if "async_moves" in extra:  # removed: saves are never waited for, and `loads` says when loads land
            raise ValueError("kv_connector_extra_config: async_moves was removed; use loads='sync' or 'async' "
                             "(default 'auto')")
        gone = sorted(k for k in ("path", "mover", "staging_blocks") if k in extra)
        if gone:  # removed with the staging pool: every page moves in one copy each way, by the engine's mover
            raise ValueError(f"kv_connector_extra_config: {gone} removed: pages move in one copy each way between "
                             "vLLM's blocks and the host tier's slots (the staging pool and the cma mover are gone)")
        unknown = sorted(k for k in extra if k not in known)
        if unknown:
            raise ValueError(f"kv_connector_extra_config: unknown key(s) {unknown}; known: {sorted(known)}")
        return cls(**extra)


class _VllmLayout:
    """The kvproc `KvModel` the host tier learns vLLM's page shape from: one arena per vLLM layer (in its group), one
    block each, laid out as vLLM's blocks (pages move between vLLM's tensors and the tier's slots: nothing is copied
    through these arenas). One set per rank (tensor parallel)."""

    def __init__(self, contract: VllmKvContract, allocator: Any, ranks: int = 1) -> None:
        self._spec = contract.spec
        # a state group's arenas: its pool's one live slot (unused: the live state is vLLM's) and one checkpoint slot
        blocks = {g.name: 2 if g.state else 1 for g in contract.groups}
        self._ranks = [[(g.name, KvArena(f"vllm.{name}", allocator(f"vllm.{name}", blocks[g.name] * g.bytes_per_block),
                                         blocks[g.name], g.bytes_per_block, g.bytes_per_block))
                        for g in contract.groups for name in g.layer_names] for _ in range(ranks)]

    def spec(self) -> KvSpec:
        return self._spec

    def arenas(self, rank: int) -> Sequence[tuple[str, KvArena]]:
        return self._ranks[rank]

    def repack(self, group: str, direction: RepackDirection, src: torch.Tensor, dst: torch.Tensor,
               arena: ArenaId) -> None:
        dst.copy_(src)  # stored as vLLM lays blocks out (no stored_layout declared): never called


@dataclass(eq=False)
class KvprocRuntime:
    engine_id: str
    contract: VllmKvContract
    options: RuntimeOptions
    cluster: ClusterStore
    store: KvStore
    model: Any  # the tier's model: vLLM's layout (`_VllmLayout`), or SGLang's page model (page_format)
    users: int = 0
    closed: bool = False
    # Counters both sides bump (the scheduler side: hits; the worker side: copies); read by tests and docs.
    counters: dict[str, int] = field(default_factory=dict)
    moves: MoveQueue | None = None  # made by the worker side when vLLM registers its tensors
    direct: HostDirect | None = None  # the engine's view of the host tier (rank 0's)
    directs: list[HostDirect] = field(default_factory=list)  # ... of every rank's tier (tensor parallel)

    def count(self, name: str, n: int = 1) -> None:
        with _lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self.moves is not None:
                self.moves.close()
            for d in self.directs:
                d.close()
            self.cluster.close()
        finally:
            log.info("vllm_connector_closed", engine_id=self.engine_id, counters=self.counters)


def acquire(engine_id: str, contract: VllmKvContract, options: RuntimeOptions, ranks: int = 1,
            tier_model: Any = None) -> KvprocRuntime:
    """The engine's runtime, started by the first caller (the worker side, usually): one reference per caller.
    `ranks`: one host tier per tensor-parallel rank (the scheduler side's, `tp.py`). `tier_model(allocator)`: the
    model attached to the tier instead of vLLM's layout (page_format="sglang" attaches SGLang's page model)."""
    with _lock:
        rt = _runtimes.get(engine_id)
        if rt is not None and not rt.closed:
            if rt.contract != contract:
                raise RuntimeError(f"engine {engine_id!r}: the scheduler and the worker see different KV layouts "
                                   f"({rt.contract} vs {contract})")
            rt.users += 1
            return rt
        if options.kv_events and options.tier_runtime_dir is not None:
            check_shared_tier_events(options.tier_runtime_dir, options.kv_events_tokens)
        own_events = options.kv_events and options.tier_runtime_dir is None
        interval_ms = options.kv_events_interval_ms
        cs = ClusterStore.start(host_bytes=options.host_bytes, name=f"vllm{abs(hash(engine_id)) % 10**8}", ranks=ranks,
                                log_level=options.log_level, tier_runtime_dir=options.tier_runtime_dir,
                                kv_events=own_events, kv_events_tokens=own_events and options.kv_events_tokens,
                                kv_events_interval_s=DEFAULT_INTERVAL_S if interval_ms is None else interval_ms / 1000)
        try:
            model = _VllmLayout(contract, cs.allocator, ranks) if tier_model is None else tier_model(cs.allocator)
            store = cs.attach_model(model, live_slots=1, config=StoreConfig())
            # one per tier: a REPLICATED model (an MLA latent) has one for all its ranks
            directs = [HostDirect(store, seg, r) for r, seg in enumerate(cs.host_segments)]
        except BaseException:
            cs.close()
            raise
        rt = KvprocRuntime(engine_id, contract, options, cs, store, model, users=1, direct=directs[0],
                           directs=directs)
        _runtimes[engine_id] = rt
        log.info("vllm_connector_started", engine_id=engine_id, ranks=ranks,
                 host_bytes=options.host_bytes, layers=len(contract.layer_names),
                 groups={g.name: (g.vllm_spec, len(g.layer_names), g.bytes_per_block) for g in contract.groups},
                 page_tokens=contract.block_tokens,
                 runtime_dir=cs.cluster.runtime_dir, kv_events=kv_event_endpoints(
                     options.tier_runtime_dir or cs.cluster.runtime_dir) if options.kv_events else {})
        return rt


def kv_event_endpoints(runtime_dir: str) -> dict[str, dict[str, str]]:
    """Each host tier's KV-event endpoints and settings, by "host_tier[r]", as its manifest names them: what a
    router subscribes to (the connector logs them at start: `vllm_connector_started`)."""
    manifest = mf.read_manifest(runtime_dir)
    return {f"host_tier[{p.rank}]": dict(p.published) for p in manifest.processes
            if p.role == "host_tier" and "kv_events" in p.published}


def check_shared_tier_events(runtime_dir: str, tokens: bool) -> None:
    """An engine that asks for KV events and attaches to a shared tier: that tier must publish them (and carry token
    ids when asked), since only `kvproc up` can turn them on; refused with the flag to add, before anything
    starts."""
    manifest = mf.read_manifest(mf.find_runtime_dir(runtime_dir=runtime_dir))
    for p in manifest.processes:
        if p.role != "host_tier":
            continue
        if "kv_events" not in p.published:
            raise ValueError(f"kv_connector_extra_config: kv_events asks for the host tier's KV events, but the shared"
                             f" tier host_tier[{p.rank}] at {runtime_dir} publishes none: start it with "
                             "`kvproc up --kv-events`")
        if tokens and p.published.get("kv_events_tokens") != "1":
            raise ValueError(f"kv_connector_extra_config: kv_events_tokens asks for token ids, but the shared tier "
                             f"host_tier[{p.rank}] at {runtime_dir} publishes none: start it with "
                             "`kvproc up --kv-events --kv-events-tokens`")


def release(rt: KvprocRuntime) -> None:
    with _lock:
        rt.users -= 1
        last = rt.users <= 0
        if last and _runtimes.get(rt.engine_id) is rt:
            del _runtimes[rt.engine_id]
    if last:
        rt.close()


def live_runtimes() -> list[KvprocRuntime]:
    """The runtimes of this process's engines (tests and tools read counters and stats through them)."""
    with _lock:
        return [rt for rt in _runtimes.values() if not rt.closed]


@atexit.register
def _close_all() -> None:
    with _lock:
        left = list(_runtimes.values())
        _runtimes.clear()
    for rt in left:
        rt.close()
