"""kvproc's HiCache backend against SGLang's own storage interface and host pools (the installed package): pages come
back bit for bit through the zero-copy and the flat interfaces, `batch_exists` counts the leading run, misses are
misses, and bad input is refused with a typed error. Each backend here starts a host tier of its own (real processes,
shared memory), torn down and checked for leftovers by the `backend` context."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvproc.integrations.sglang import KvprocHiCacheStorage, SglangConfigError, SglangInputError
from kvproc.integrations.sglang.errors import SglangNotReadyError
from tests.integrations.sglang.conftest import PAGE, backend, host_pool, page_bytes, storage_config

pytestmark = pytest.mark.timeout(180)


def keys(n: int, tag: str = "a") -> list[str]:
    # SGLang's keys are 64 hex characters (a SHA-256 chain); any distinct strings serve here.
    return [f"{tag}{i:063x}" for i in range(n)]


def pages(first: int, n: int) -> torch.Tensor:
    """Host indices of n whole pages from page `first` (SGLang's host allocator hands pages out whole)."""
    return torch.arange(first * PAGE, (first + n) * PAGE, dtype=torch.int64)


@pytest.mark.parametrize("kind,layout", [("mha", "page_first"), ("mha", "page_first_direct"), ("mha", "layer_first"),
                                         ("mla", "page_first"), ("mla", "layer_first")])
def test_set_then_get_v1_is_bit_exact_into_other_pages(kind: str, layout: str) -> None:
    pool = host_pool(kind, layout)
    with backend(pool, mla=kind == "mla") as b:
        assert isinstance(b, KvprocHiCacheStorage)  # SGLang's factory made ours, not a wrapper
        sent = [page_bytes(pool, p * PAGE) for p in range(4)]
        assert b.batch_set_v1(keys(4), pages(0, 4)) == [True] * 4
        before = [page_bytes(pool, p * PAGE) for p in range(8, 12)]
        assert b.batch_get_v1(keys(4), pages(8, 4)) == [True] * 4
        got = [page_bytes(pool, p * PAGE) for p in range(8, 12)]
        assert got == sent and got != before
        assert b.kvproc_counters()["get_hit_pages"] == 4


def test_batch_exists_is_the_leading_run_and_misses_load_nothing() -> None:
    pool = host_pool()
    with backend(pool) as b:
        k = keys(6)
        assert b.batch_exists(k) == 0 and not b.exists(k[0])
        assert b.batch_set_v1(k[:3], pages(0, 3)) == [True] * 3
        assert b.batch_set_v1(k[4:5], pages(4, 1)) == [True]  # key 3 missing: the run stops there
        assert b.batch_exists(k) == 3
        assert b.batch_exists(k[4:]) == 1 and b.exists(k[4]) and not b.exists(k[5])
        assert b.batch_exists([]) == 0
        untouched = [page_bytes(pool, p * PAGE) for p in range(8, 12)]
        # a miss in the middle: what follows it is not loaded either (SGLang wants a prefix)
        assert b.batch_get_v1([k[0], k[3], k[1], k[2]], pages(8, 4)) == [True, False, False, False]
        assert [page_bytes(pool, p * PAGE) for p in range(9, 12)] == untouched[1:]
        assert page_bytes(pool, 8 * PAGE) == page_bytes(pool, 0)
        assert b.batch_get_v1(keys(2, "z"), pages(10, 2)) == [False, False]
        assert [page_bytes(pool, p * PAGE) for p in range(10, 12)] == untouched[2:]


def test_the_flat_interface_round_trips_sglangs_own_data_pages() -> None:
    """The non-zero-copy path as SGLang's controller drives it: `get_data_page` out, `get_dummy_flat_data_page` in,
    `set_from_flat_data_page` back into the pool (MHA layer_first: the layout whose flat order differs)."""
    pool = host_pool("mha", "layer_first")
    with backend(pool, interface_v1=False) as b:
        k = keys(3)
        values = [pool.get_data_page(p * PAGE, flat=True) for p in range(3)]
        assert b.batch_set(k, values)
        dst = [pool.get_dummy_flat_data_page() for _ in range(4)]
        got = b.batch_get(k + keys(1, "z"), dst)
        assert got[3] is None and all(g is d for g, d in zip(got[:3], dst))
        for i in range(3):
            pool.set_from_flat_data_page(pages(8 + i, 1)[0].item(), got[i])
        assert [page_bytes(pool, p * PAGE) for p in range(8, 11)] == [page_bytes(pool, p * PAGE) for p in range(3)]
        assert b.set(keys(1, "s")[0], values[0]) and b.exists(keys(1, "s")[0])
        one = pool.get_dummy_flat_data_page()
        assert b.get(keys(1, "s")[0], one) is one and b.get(keys(1, "y")[0], pool.get_dummy_flat_data_page()) is None
        with pytest.raises(SglangInputError, match="interface_v1"):  # its bytes are in the flat order
            b.batch_get_v1(k, pages(0, 3))


def test_a_corrupted_tier_page_is_seen_by_the_bit_exact_check() -> None:
    """Control of the round-trip test: flip one byte of a stored page in the tier's slot and the page that comes
    back differs, so the bit-exact comparison above can fail."""
    pool = host_pool()
    with backend(pool) as b:
        sent = page_bytes(pool, 0)
        assert b.batch_set_v1(keys(1), pages(0, 1)) == [True]
        hit = b._direct.lookup("control", b._keys.keys(keys(1))).result(30)
        b._view[hit.page_slots[0], 7] ^= 0xFF
        b._direct.release(hit.lease_id)
        assert b.batch_get_v1(keys(1), pages(5, 1)) == [True]
        assert page_bytes(pool, 5 * PAGE) != sent


@pytest.mark.parametrize("call,error", [
    (lambda b: b.batch_set_v1([b"bytes-key"], pages(0, 1)), "non-empty string"),
    (lambda b: b.batch_exists("abc"), "list of strings"),
    (lambda b: b.batch_set_v1(keys(2), pages(0, 1)), "need 32 host indices"),
    (lambda b: b.batch_get_v1(keys(1), torch.arange(3, 3 + PAGE)), "whole pages"),
    (lambda b: b.batch_get_v1(keys(1), torch.arange(PAGE, dtype=torch.float32)), "integer tensor"),
    (lambda b: b.batch_set_v1(keys(1), pages(10_000, 1)), "out of the host pool"),
    (lambda b: b.batch_set(keys(1), [torch.zeros(3)]), "interface_v1"),
])
def test_bad_input_is_refused_with_a_typed_error(call: Any, error: str) -> None:
    pool = host_pool()
    with backend(pool) as b:
        with pytest.raises(SglangInputError, match=error):
            call(b)
        assert b.batch_set_v1(keys(1), pages(0, 1)) == [True]  # still serving after the refusals


def test_bad_configs_are_refused_at_creation() -> None:
    with pytest.raises(SglangConfigError, match=r"unknown key\(s\) \['host_byte'\]"):
        KvprocHiCacheStorage(storage_config(host_byte=1))
    with pytest.raises(SglangConfigError, match="host_bytes must be a positive int"):
        KvprocHiCacheStorage(storage_config(host_bytes=-1))
    with pytest.raises(SglangConfigError, match="no model identity"):
        KvprocHiCacheStorage(storage_config(model=""))
    with pytest.raises(SglangConfigError, match="HiCacheStorageConfig expected"):
        KvprocHiCacheStorage(None)
    b = KvprocHiCacheStorage(storage_config())
    with pytest.raises(SglangNotReadyError, match="register_mem_pool_host comes first"):
        b.batch_exists(keys(1))
    b.close()


def test_flat_pages_of_the_wrong_size_are_refused() -> None:
    pool = host_pool("mha", "page_first")
    with backend(pool, interface_v1=False) as b:
        with pytest.raises(SglangInputError, match="contiguous host tensor of 3072 bytes"):
            b.batch_set(keys(1), [torch.zeros(10, dtype=torch.bfloat16)])
        with pytest.raises(SglangInputError, match="1 keys need 1 page tensors"):
            b.batch_get(keys(1), [])


def test_prefetch_and_backup_threads_at_once() -> None:
    """SGLang calls the backend from its prefetch and its backup thread at the same time: sets and gets of disjoint
    pages on two threads each come back bit for bit."""
    import concurrent.futures

    pool = host_pool(tokens=512)
    with backend(pool) as b:
        def worker(t: int) -> bool:
            for r in range(6):
                k = keys(2, f"t{t}r{r}")
                src, dst = 4 * t, 4 * t + 2
                assert b.batch_set_v1(k, pages(src, 2)) == [True, True]
                assert b.batch_exists(k) == 2
                assert b.batch_get_v1(k, pages(dst, 2)) == [True, True]
                assert [page_bytes(pool, (dst + i) * PAGE) for i in range(2)] == \
                    [page_bytes(pool, (src + i) * PAGE) for i in range(2)]
            return True

        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            assert all(ex.map(worker, range(4)))


def test_storage_metrics_feed_sglangs_own_collector() -> None:
    """With `--enable-storage-metrics` SGLang drains `get_stats()` into its Prometheus histograms (and sets an
    attribute on what it got): the backend answers its `StorageMetrics`, one entry per call, drained by each read;
    off, None (SGLang then logs nothing)."""
    from prometheus_client import REGISTRY
    from sglang.srt.observability.metrics_collector import StorageMetrics, StorageMetricsCollector

    with backend(host_pool(), metrics=False) as off:
        assert off.batch_set_v1(keys(1), pages(0, 1)) == [True] and off.get_stats() is None
    with backend(host_pool(), metrics=True) as b:
        assert b.batch_set_v1(keys(3), pages(0, 3)) == [True] * 3
        assert b.batch_get_v1(keys(2), pages(4, 2)) == [True] * 2
        assert b.batch_get_v1(keys(1, "z"), pages(6, 1)) == [False]  # a miss moves nothing: not an entry
        stats = b.get_stats()
        assert isinstance(stats, StorageMetrics)
        assert stats.backup_pgs == [3] and stats.prefetch_pgs == [2]
        assert all(v > 0 for v in stats.backup_bandwidth + stats.prefetch_bandwidth)
        labels = {"storage_backend": f"kvproc-test-{b.name}"}
        collector = StorageMetricsCollector(labels)
        if not hasattr(stats, "prefetch_stats"):  # what SGLang's radix cache does before logging
            stats.prefetch_stats = None
        collector.log_storage_metrics(stats)
        assert REGISTRY.get_sample_value("sglang:prefetch_pgs_sum", labels) == 2
        assert REGISTRY.get_sample_value("sglang:backup_pgs_sum", labels) == 3
        assert b.get_stats() == StorageMetrics()  # drained


def test_a_hybrid_models_side_pools_are_refused_at_start() -> None:
    """A hybrid model registers its state pools for SGLang's `*_v2` calls (not served yet): the attach fails when
    registration ends, naming them; a plain model's registration (the KV pool alone) goes through."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    pool = host_pool()
    with backend(pool) as b:
        b.register_mem_host_pool_v2(pool, PoolName.KV)
        b.on_host_pools_registered()
        b.register_mem_host_pool_v2(host_pool(), PoolName.MAMBA)
        with pytest.raises(SglangConfigError, match=r"\['mamba'\].*\*_v2"):
            b.on_host_pools_registered()
