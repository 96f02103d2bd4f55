"""Fixtures of the SGLang HiCache backend tests: SGLang's own host pools and storage config, built from the installed
package (not copies), and backends on a tier of their own or on a `kvproc up` tier.

These tests need SGLang (`make venv-sglang`: the `.venv-sglang` environment; `make test` runs them there). In an
environment without it (kvproc's own `.venv`) this directory is not collected at all. SGLang's engine does not run on
a CPU machine; its storage layer does, and that is what is tested here (docs/sglang.md).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from typing import Any, Iterator

import pytest

if importlib.util.find_spec("sglang") is None:
    collect_ignore_glob = ["test_*.py"]

# Unique to this test process: segment checks count by cluster name.
SGL_CLUSTER = f"sglup{os.getpid()}"
PAGE = 16
MODULE = "kvproc.integrations.sglang"


def host_pool(kind: str = "mha", layout: str = "page_first", *, tokens: int = 256, layers: int = 3,
              dtype: str = "bfloat16", heads: int = 2, head_dim: int = 8, page: int = PAGE) -> Any:
    """One of SGLang's host pools on CPU (its device pool on CPU first: the host pool is built from its buffer
    info, as SGLang's scheduler builds it), filled with random bytes."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dt = getattr(torch, dtype)
    if kind == "mha":
        dev = MHATokenToKVPool(tokens, page, dt, heads, head_dim, layers, "cpu", False, start_layer=0,
                               end_layer=layers - 1)
        pool = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page, layout,
                                    pin_memory=False, device_capacity_tokens=dev.size, start_layer=0,
                                    end_layer=layers - 1, write_back_staging=dev.hicache_write_back_staging)
    else:
        dev = MLATokenToKVPool(tokens, page, dt, 4 * head_dim, head_dim, layers, "cpu", False, start_layer=0,
                               end_layer=layers - 1)
        pool = MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page, layout,
                                    pin_memory=False, device_capacity_tokens=dev.size, start_layer=0,
                                    end_layer=layers - 1, target_layer_num=layers)
    fill_random(pool, 0)
    return pool


def fill_random(pool: Any, seed: int) -> None:
    import torch

    flat = pool.kv_buffer.reshape(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed)))


def kv_at(pool: Any, layer: int, token: int) -> tuple[Any, Any]:
    """K and V ([heads, head dim] tensors) of one layer and token of an MHA host pool, read from its kv_buffer as
    SGLang's `init_kv_buffer` lays each layout out (not through the backend's page copies)."""
    buf, n, layout = pool.kv_buffer, pool.page_size, pool.layout
    if layout == "layer_first":  # (2, layers, tokens, heads, dim)
        kv = buf[:, layer, token]
    elif layout == "page_first":  # (2, tokens, layers, heads, dim)
        kv = buf[:, token, layer]
    elif layout == "page_first_direct":  # (2, pages, layers, page tokens, heads, dim)
        kv = buf[:, token // n, layer, token % n]
    elif layout == "page_head":  # (2, pages, heads, page tokens, layers, dim)
        kv = buf[:, token // n, :, token % n, layer]
    else:
        raise ValueError(layout)
    return kv[0], kv[1]


def page_bytes(pool: Any, first_token: int) -> bytes:
    """A page's bytes as SGLang's own flat page (`get_data_page`): compared as bytes, never as floats (random bits
    make NaNs, which compare unequal to themselves)."""
    import torch

    return pool.get_data_page(first_token, flat=True).contiguous().view(torch.uint8).numpy().tobytes()


def storage_config(*, model: str = "tests/tiny-model", interface_v1: bool = True, tp_rank: int = 0,
                   tp_size: int = 1, mla: bool = False, metrics: bool = False, **extra: Any) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    cfg = {"backend_name": "kvproc", "module_path": MODULE, "class_name": "KvprocHiCacheStorage",
           "interface_v1": int(interface_v1), **extra}
    cfg.setdefault("host_bytes", 8 << 20)  # a shared tier's too: `kvproc_up` starts one of 8 MiB
    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=metrics,
                                is_page_first_layout=True, model_name=model, extra_config=cfg)


@contextlib.contextmanager
def backend(pool: Any, **cfg: Any) -> Iterator[Any]:
    """A backend made by SGLang's own factory (`dynamic`, as `--hicache-storage-backend dynamic` makes it), the host
    pool registered as SGLang's cache controller registers it; closed on exit, and nothing of its own tier left."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    from kvproc.ipc.segment import list_segments

    b = StorageBackendFactory.create_backend("dynamic", storage_config(**cfg), pool)
    try:
        b.register_mem_pool_host(pool)
        yield b
    finally:
        b.close()
    assert not list_segments(b.name)


def tier_stats(b: Any) -> dict[str, int]:
    """The host tier's own counters (open leases, saves, entries), asked of the tier process."""
    assert b._cluster is not None and b._cluster.store is not None
    tier = b._cluster.tiers[0]
    return b._cluster.store.submit(tier.stats()).result(30)


@pytest.fixture
def shared_tier() -> Iterator[str]:
    """A `kvproc up` tier for one test (its own process tree; a tier serves one fingerprint, the first to attach)."""
    from tests.conftest import kvproc_up

    with kvproc_up(SGL_CLUSTER) as (rd, _):
        yield rd
