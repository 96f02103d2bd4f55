"""`KvprocHiCacheStorage`: SGLang HiCache's L3 storage backend on kvproc's host tier.

SGLang's HiCache keeps KV in three levels: device pages, its host memory pool, and an L3 storage backend behind
`HiCacheStorage`, which it loads by name (`--hicache-storage-backend dynamic` plus module and class in the extra
config) as `Cls(storage_config, kwargs)`, then hands the host pool to `register_mem_pool_host`. Pages move between
that host pool and kvproc's host tier in one copy each way (`kvproc/store/host_direct.py`): a get leases the tier's
slots of the longest present prefix, copies them into the pool and releases the lease (a copy whose lease grew too
old, or whose slot was handed to a save meanwhile, is reported failed: SGLang then recomputes); a set reserves slots,
copies the pool's pages into them under the save's fence and commits. The tier is a `kvproc up` tier several engines
share (`tier_runtime_dir`) or one the backend starts for itself.

The tier is configured at `register_mem_pool_host`, when the page format is known: its fingerprint names the model
identity, the page size and the page format (`pages.py`), and a shared tier serving another fingerprint refuses the
backend (SglangConfigError at the engine's start). Every key is namespaced by that fingerprint and the rank's shard
(`keys.py`).

SGLang calls the backend from its prefetch and backup threads at once; every call blocks its caller only, its tier
work runs on the store's loop.
"""

from __future__ import annotations

import atexit
import itertools
import os
import threading
import time
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np
import structlog
import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageExtraInfo

from kvproc import ClusterStore, KvContractError, StoreConfig
from kvproc.integrations.sglang.errors import (
    SglangConfigError,
    SglangInputError,
    SglangNotReadyError,
)
from kvproc.integrations.sglang.keys import KeySpace, shard_of
from kvproc.integrations.sglang.model import SglangPageModel
from kvproc.integrations.sglang.options import BackendOptions
from kvproc.ipc.errors import RemoteError
from kvproc.integrations.sglang.pages import HostPoolPages
from kvproc.store.cluster import fingerprint
from kvproc.store.host_direct import HostDirect
from kvproc.tiers.host_index import Hit, SaveTicket

log = structlog.get_logger("kvproc.integrations.sglang")

_ids = itertools.count()
_open: "weakref.WeakSet[KvprocHiCacheStorage]" = weakref.WeakSet()


class KvprocHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: Any, kwargs: Any = None) -> None:
        if storage_config is None or not hasattr(storage_config, "tp_rank"):
            raise SglangConfigError(f"kvproc backend: SGLang's HiCacheStorageConfig expected, got "
                                    f"{type(storage_config).__name__}")
        self.config = storage_config
        self.options = BackendOptions.from_extra(storage_config.extra_config)
        self.model_id = self.options.model_id or storage_config.model_name
        if not self.model_id:
            raise SglangConfigError("kvproc backend: no model identity: SGLang gave no model name; set model_id in "
                                    "the extra config (it is part of every key)")
        self.zero_copy = self.options.interface_v1
        self.shard = shard_of(storage_config)
        self.name = f"sgl{os.getpid()}x{next(_ids)}"  # the cluster of the tier it may start: unique on the machine
        self.counters: dict[str, int] = {}
        self._lock = threading.Lock()
        # SGLang's storage metrics (`--enable-storage-metrics`): pages and GB/s of each get and set call since the
        # last `get_stats`, as its collector reads them
        self._metrics = bool(getattr(storage_config, "enable_storage_metrics", False))
        self._ops: dict[str, list[float]] = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                                             "backup_bandwidth": []}
        self._cluster: ClusterStore | None = None
        self._direct: HostDirect | None = None
        self._pages: HostPoolPages | None = None
        self._keys: KeySpace | None = None
        self._view: np.ndarray | None = None
        self.fingerprint = ""
        self.closed = False
        _open.add(self)

    # -- set-up -----------------------------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Learn the page format from SGLang's host pool and attach to the tier (configuring it, or joining it if
        its fingerprint is ours). A second registration must bring the same format."""
        pages = HostPoolPages(mem_pool_host)
        if self._pages is not None:
            if pages.format != self._pages.format:
                raise SglangConfigError(f"kvproc backend: a host pool of another format registered "
                                        f"({pages.format} after {self._pages.format})")
            self.mem_pool_host, self._pages = mem_pool_host, pages
            return
        self.mem_pool_host = mem_pool_host
        o = self.options
        cs = ClusterStore.start(host_bytes=o.host_bytes, name=self.name,
                                log_level=o.log_level, tier_runtime_dir=o.tier_runtime_dir)
        try:
            try:
                model = SglangPageModel(pages.format, self.model_id, self.zero_copy, cs.allocator)
                store = cs.attach_model(model, live_slots=1, config=StoreConfig())
            except KvContractError as e:
                raise SglangConfigError(f"kvproc backend: SGLang's pages cannot be stored: {e}") from e
            except RemoteError as e:  # the tier refused us (another fingerprint, or too large), named in the message
                raise SglangConfigError(f"kvproc backend: the host tier refused this engine's pages: {e}") from e
            direct = HostDirect(store, cs.host_segment)
        except BaseException:
            cs.close()
            raise
        self._cluster, self._direct, self._pages = cs, direct, pages
        self._view = direct.views[model.arena_name]
        self.fingerprint = fingerprint(model, store.layouts[0])
        self._keys = KeySpace(self.fingerprint, self.shard)
        log.info("sglang_backend_started", fingerprint=self.fingerprint, shard=self.shard,
                 runtime_dir=o.tier_runtime_dir or cs.cluster.runtime_dir, zero_copy=self.zero_copy,
                 page_bytes=pages.format.page_bytes)

    def on_host_pools_registered(self) -> None:
        """SGLang's end of host-pool registration. A hybrid model's side pools (Mamba, SWA, indexer states) move
        through the `*_v2` calls, which this backend does not serve yet: refused here, so the engine fails at start
        naming them, rather than logging a failed prefetch or backup on every request."""
        side = sorted(str(n) for n in getattr(self, "registered_pools", {}) if str(n) != "kv")
        if side:
            raise SglangConfigError(f"kvproc backend: host pools {side} (a hybrid model's states) go through "
                                    "SGLang's *_v2 storage calls, not served by kvproc's backend yet; use SGLang's "
                                    "file or Mooncake backend for this model")

    def _ready(self) -> tuple[HostDirect, HostPoolPages, KeySpace, np.ndarray]:
        if self.closed:
            raise SglangNotReadyError("kvproc backend: closed")
        if self._direct is None or self._pages is None or self._keys is None or self._view is None:
            raise SglangNotReadyError("kvproc backend: register_mem_pool_host comes first (it fixes the page "
                                      "format the tier stores)")
        return self._direct, self._pages, self._keys, self._view

    def _interface(self, zero_copy: bool) -> None:
        if zero_copy != self.zero_copy:
            want = "batch_get_v1 / batch_set_v1" if self.zero_copy else "get / set / batch_get / batch_set"
            raise SglangInputError(f"kvproc backend: this backend stores pages for {want} (extra config "
                                   f"interface_v1={int(self.zero_copy)}); the other interface's byte order differs")

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] = self.counters.get(name, 0) + n

    def _op(self, kind: str, pages: int, started: float) -> None:
        """One get ("prefetch") or set ("backup") call's pages and bandwidth, for SGLang's storage metrics."""
        if not self._metrics or not pages or self._pages is None:
            return
        gb = pages * self._pages.format.page_bytes / 1e9
        with self._lock:
            self._ops[f"{kind}_pgs"].append(pages)
            self._ops[f"{kind}_bandwidth"].append(gb / max(time.perf_counter() - started, 1e-9))

    def _req(self, op: str) -> str:
        return f"{self.name}-{op}-{next(_ids)}"

    # -- lookups ----------------------------------------------------------------------------------------------------
    def _lease(self, op: str, keys: Sequence[str]) -> tuple[HostDirect, Hit | None, float]:
        direct, _, space, _ = self._ready()
        tkeys = space.keys(keys)
        if not tkeys:
            return direct, None, 0.0
        hit = direct.lookup(self._req(op), tkeys).result(4 * direct.timeout_s)
        return direct, hit, time.monotonic()

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        """The length of the leading run of `keys` the tier holds (SGLang prefetches that many)."""
        direct, hit, _ = self._lease("exists", keys)
        if hit is None:
            return 0
        direct.release(hit.lease_id)
        self.count("exists_pages", hit.pages)
        return hit.pages

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def _load(self, op: str, keys: Sequence[str], rows_to: Any) -> int:
        """Lease the leading run of `keys`, hand each leased slot's row to `rows_to(i, row)`, release: the number of
        pages loaded (0 when the copy cannot be trusted)."""
        started = time.perf_counter()
        direct, hit, leased_at = self._lease(op, keys)
        if hit is None:
            self.count("get_miss_pages", len(keys))
            return 0
        view = self._view
        assert view is not None
        try:
            for i, slot in enumerate(hit.page_slots[:hit.pages]):
                rows_to(i, view[slot])
            if not direct.intact(hit.page_slots[:hit.pages], hit.page_gens[:hit.pages], leased_at, time.monotonic()):
                self.count("get_lease_lost")
                log.warning("sglang_get_lease_lost", pages=hit.pages)
                return 0
        finally:
            direct.release(hit.lease_id)
        self.count("get_hit_pages", hit.pages)
        self.count("get_miss_pages", len(keys) - hit.pages)
        self._op("prefetch", hit.pages, started)
        return hit.pages

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Zero-copy get: the tier's pages straight into the host pool's pages `host_indices` names. True for the
        leading run of keys loaded, False after it."""
        self._interface(True)
        _, pages, space, _ = self._ready()
        space.keys(keys)  # bad keys fail before any lease is taken
        off = pages.offsets(host_indices, len(keys))
        n = self._load("get", keys, lambda i, row: pages.write(row, off[i]))
        return [i < n for i in range(len(keys))]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        """Pages into SGLang's flat page tensors (`target_locations`, one a key); None after the leading run."""
        self._interface(False)
        _, pages, space, _ = self._ready()
        space.keys(keys)
        dst = self._flat_targets(keys, target_locations, pages.format.page_bytes)

        def into(i: int, row: np.ndarray) -> None:
            dst[i][:] = row

        n = self._load("get", keys, into)
        return [target_locations[i] if i < n else None for i in range(len(keys))]

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    # -- saves ------------------------------------------------------------------------------------------------------
    def _save(self, keys: Sequence[str], rows_from: Any, extra_info: HiCacheStorageExtraInfo | None) -> bool:
        direct, _, space, view = self._ready()
        tkeys = space.keys(keys)
        if not tkeys:
            return True
        prefix = extra_info.prefix_keys if extra_info is not None else None
        parent = space.key(prefix[-1]) if prefix else None  # the tier's KV events chain the run to its parent

        def write(ticket: SaveTicket) -> None:
            for i, slot in enumerate(ticket.page_slots):
                if slot is not None:  # None: the tier has the page already
                    rows_from(i, view[slot])

        started = time.perf_counter()
        ok = direct.save(self._req("set"), tkeys, write, parent=parent)
        self.count("set_pages" if ok else "set_failed_pages", len(tkeys))
        if ok:
            self._op("backup", len(tkeys), started)
        return ok

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        """Zero-copy set: the host pool's pages `host_indices` names into the tier, as one save (all or none)."""
        self._interface(True)
        _, pages, _, _ = self._ready()
        off = pages.offsets(host_indices, len(keys))
        ok = self._save(keys, lambda i, row: pages.read(off[i], row), extra_info)
        return [ok] * len(keys)

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        """SGLang's flat page tensors (`values`, one a key) into the tier, as one save."""
        self._interface(False)
        _, pages, _, _ = self._ready()
        src = self._flat_targets(keys, values, pages.format.page_bytes)

        def from_(i: int, row: np.ndarray) -> None:
            row[:] = src[i]

        return self._save(keys, from_, None)

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    @staticmethod
    def _flat_targets(keys: Sequence[str], tensors: Any, page_bytes: int) -> list[np.ndarray]:
        if not isinstance(tensors, Sequence) or len(tensors) != len(keys):
            raise SglangInputError(f"{len(keys)} keys need {len(keys)} page tensors, got "
                                   f"{len(tensors) if isinstance(tensors, Sequence) else type(tensors).__name__}")
        out = []
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous() or \
                    t.numel() * t.element_size() != page_bytes:
                raise SglangInputError(f"a page tensor must be a contiguous host tensor of {page_bytes} bytes, got "
                                       f"{type(t).__name__} {getattr(t, 'shape', '')} {getattr(t, 'dtype', '')}")
            out.append(t.reshape(-1).view(torch.uint8).numpy())
        return out

    # -- the rest of SGLang's interface -----------------------------------------------------------------------------
    def clear(self) -> None:
        """SGLang's flush: kvproc's tier may be shared by other engines, so nothing is dropped there (its LRU and
        TTLs manage it); logged so that a user who expected an empty L3 sees why."""
        log.info("sglang_backend_clear_ignored", reason="the host tier may be shared; its LRU evicts")

    def get_stats(self) -> Any:
        """SGLang's `StorageMetrics` of the calls since the last call (its collector drains it into Prometheus
        histograms with `--enable-storage-metrics`), or None when those metrics are off. kvproc's own counters:
        `kvproc_counters`."""
        if not self._metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        with self._lock:
            ops = {k: list(v) for k, v in self._ops.items()}
            for v in self._ops.values():
                v.clear()
        return StorageMetrics(**ops)

    def kvproc_counters(self) -> dict[str, int]:
        """Pages hit, missed, set and failed, and leases lost, since the backend started."""
        with self._lock:
            return dict(self.counters)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            if self._direct is not None:
                self._direct.close()
            if self._cluster is not None:
                self._cluster.close()
        finally:
            _open.discard(self)
            log.info("sglang_backend_closed", counters=self.counters)


@atexit.register
def _close_all() -> None:
    for b in list(_open):
        b.close()
