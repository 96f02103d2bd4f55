"""The one place that builds a model and its store for the engine, per run mode.

Modes:
- `no_cache`: a store with no tier; the engine runs with prefix caching off (never resolves, never seals).
- `device_only`: prefix caching from the device pool only (no tier).
- `kvproc`: the device pool plus the host tier and its copy path.

With `processes=True` (what `kvproc demo` runs) the `device_only` and `kvproc` stores are `kvproc.store.cluster`
stores: the copy worker (and, for `kvproc`, the host tier) run as their own processes, the model's arenas live in
shared memory the scheduler owns. `processes=False` keeps everything in this process (`build_local_store`): the
tests use it, being faster to start.

`ranks=N` (tensor parallel): a `RankedModel` of N replicas and a store of N ranks (a device pool, copy worker and host
tier each), driven by `Engine(..., ranks=N)`.
"""

from __future__ import annotations

import collections
import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Self

from kvproc.contract import GroupKind
from kvproc.engine.models import TinyModel, build_model
from kvproc.engine.models.ranked import RankedModel, rank_models
from kvproc.engine.step_events import step_fence_of
from kvproc.store.build import build_local_store
from kvproc.store.kv_store import KvStore
from kvproc.store.types import StoreConfig

MODES = ("no_cache", "device_only", "kvproc")


@dataclass(frozen=True)
class PoolSizes:
    device_blocks: int  # paged blocks on the device (the pool the working set must not fit in)
    live_slots: int  # one per running request (= max batch)
    staging_slots: int  # bounded checkpoints kept on the device
    host_bytes: int  # host tier budget (kvproc mode only)
    page_tokens: int = 16


@dataclass
class Topology:
    mode: str
    model: TinyModel | RankedModel
    store: KvStore
    prefix_cache: bool
    metrics_address: str = ""  # HOST:PORT of /metrics when served
    # the copy workers' orders by mover (`mover_orders.<name>` summed over ranks), where the copies run in them
    copy_movers: Callable[[], dict[str, int]] | None = None
    _closers: list[Callable[[], None]] = field(default_factory=list)

    def close(self) -> None:
        for c in reversed(self._closers):
            with contextlib.suppress(Exception):
                c()
        self._closers.clear()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _model(model_name: str, sizes: PoolSizes, seed: int, ranks: int, **kw: Any) -> TinyModel | RankedModel:
    args: dict[str, Any] = dict(num_blocks=sizes.device_blocks, num_slots=sizes.live_slots + sizes.staging_slots,
                                page_tokens=sizes.page_tokens, seed=seed, **kw)
    return build_model(model_name, **args) if ranks == 1 else RankedModel(model_name, ranks, **args)


def make_store(mode: str, model_name: str, sizes: PoolSizes, *, seed: int = 0,
               config: StoreConfig | None = None, processes: bool = False, ranks: int = 1,
               metrics: str | None = None, remote: str | None = None, device: str = "cpu",
               copy_mover: str = "") -> Topology:
    """`metrics`: serve Prometheus /metrics there (`ClusterStore.start(metrics=)`; the process topology only).
    `remote` (with `processes`): a Mooncake Store URL for the host tier (`ClusterStore.start(remote=)`).
    `device`: where the model runs ("cpu", or "cuda" where present: its arenas are then GPU memory, which the copy
    workers open by CUDA IPC; NEEDS-GPU-CHECK, never run). `copy_mover` (with `processes`): the copy workers' mover
    kind (`ClusterStore.start(copy_mover=)`; "" the device's default)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
    config = config or StoreConfig()
    if processes and mode != "no_cache":
        return _cluster_topology(mode, model_name, sizes, seed, config, ranks, metrics, remote, device, copy_mover)
    model = _model(model_name, sizes, seed, ranks, device=device)
    # no_cache / device_only: no tier (bounded seal/restore copies still get a device copy path).
    store = build_local_store(model, live_slots=sizes.live_slots,
                              host_bytes=sizes.host_bytes if mode == "kvproc" else None, config=config, ranks=ranks)
    topo = Topology(mode, model, store, prefix_cache=mode != "no_cache")
    topo._closers.append(store.close)
    for c in store.copiers:
        topo._closers.append(c.close)
    for t in dict.fromkeys(store.tiers):  # once each (a REPLICATED model's ranks share one)
        topo._closers.append(t.close)
    return topo


def _cluster_topology(mode: str, model_name: str, sizes: PoolSizes, seed: int, config: StoreConfig,
                      ranks: int, metrics: str | None = None, remote: str | None = None,
                      device: str = "cpu", copy_mover: str = "") -> Topology:
    from kvproc.engine.repack import REPACK_PATHS
    from kvproc.store.cluster import ClusterStore

    cs = ClusterStore.start(host_bytes=sizes.host_bytes if mode == "kvproc" else 0, ranks=ranks, metrics=metrics,
                            remote=remote, copy_mover=copy_mover)
    try:
        # CPU arenas in the scheduler's shared memory; GPU arenas where the model allocates them (CUDA IPC at attach)
        where: dict[str, Any] = {"allocator": cs.allocator} if device == "cpu" else {"device": device}
        model = _model(model_name, sizes, seed, ranks, **where)
        # on a GPU the model records an event after each step, which every save and device copy waits on (on CPU:
        # None, no fence)
        store = cs.attach_model(model, live_slots=sizes.live_slots, config=config,
                                repack=REPACK_PATHS.get(model_name), step_fence=step_fence_of(rank_models(model)))
    except BaseException:
        cs.close()
        raise
    topo = Topology(mode, model, store, prefix_cache=True,
                    metrics_address=cs.cluster.metrics.address if cs.cluster.metrics is not None else "",
                    copy_movers=functools.partial(_copy_movers, cs, ranks))
    topo._closers.append(cs.close)
    return topo


def _copy_movers(cs: Any, ranks: int) -> dict[str, int]:
    """Every copy worker's orders by the mover that moved them (`kvproc/workers/movers.py`), summed over ranks."""
    from kvproc.ipc.messages import Stats

    out: collections.Counter[str] = collections.Counter()
    for r in range(ranks):
        counters = cs.cluster.client("copy_worker", r).request(Stats(), timeout=10).counters
        out.update({k.removeprefix("mover_orders."): v for k, v in counters.items() if k.startswith("mover_orders.")})
    return dict(out)


def per_page_bytes(model: TinyModel) -> tuple[int, int]:
    """(stored bytes of one page of every paged group, stored bytes of one slot of every bounded group)."""
    page = slot = 0
    for g, a in model.arenas(0):
        if model.spec().group(g).kind is GroupKind.PAGED:
            page += a.stored_bytes
        else:
            slot += a.stored_bytes
    return page, slot
