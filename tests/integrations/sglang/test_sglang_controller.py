"""SGLang's own HiCache controller (`HiCacheController`, from the installed package) driving the backend with its own
threads: it creates the backend from the `dynamic` config, its backup thread writes host pages to kvproc, its prefetch
thread asks kvproc for the hit, its I/O thread loads the pages into the host pool over the zero-copy path, its sync
thread acknowledges. Two controllers (two SGLang engines, each its own host pool) on one `kvproc up` tier: a prompt one
engine backed up is prefetched by the other, bit for bit, and a longer prompt hits only its stored prefix.

The one step done here rather than by SGLang is the scheduler's (its radix tree's): on a prefetch hit it allocates
host pages and hands the operation to the I/O thread. Process groups are gloo, one rank."""

from __future__ import annotations

import contextlib
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests.integrations.sglang.conftest import MODULE, PAGE, page_bytes

pytestmark = pytest.mark.timeout(240)
WAIT_S = 60.0  # a generous deadline for each of SGLang's queues on a loaded machine, never a timing assertion


@pytest.fixture(scope="module")
def process_group() -> Iterator[Any]:
    import torch.distributed as dist

    with tempfile.TemporaryDirectory(prefix="kvproc-sgl-pg-") as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/pg", rank=0, world_size=1)
        try:
            yield dist.group.WORLD
        finally:
            dist.destroy_process_group()


@contextlib.contextmanager
def controller(group: Any, tier: str) -> Iterator[Any]:
    """One SGLang engine's HiCache controller on CPU (a device pool, its paged allocator, a page-first host pool)
    with kvproc as its storage backend; its threads stopped and the backend closed on exit."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.runtime_context import get_parallel

    from kvproc.ipc.segment import list_segments

    dev = MHATokenToKVPool(256, PAGE, torch.bfloat16, 2, 8, 3, "cpu", False, start_layer=0, end_layer=2)
    alloc = PagedTokenToKVPoolAllocator(256, PAGE, torch.bfloat16, "cpu", dev, False)
    host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "page_first",
                                pin_memory=False, device_capacity_tokens=dev.size, start_layer=0, end_layer=2,
                                write_back_staging=dev.hicache_write_back_staging)
    extra = {"backend_name": "kvproc", "module_path": MODULE, "class_name": "KvprocHiCacheStorage",
             "interface_v1": 1, "tier_runtime_dir": tier, "host_bytes": 8 << 20}
    # what SGLang's scheduler publishes for a one-rank engine before it builds the controller
    with get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_rank=0, attn_dcp_size=1):
        cc = HiCacheController(alloc, host, PAGE, group, threading.Event(), storage_backend="dynamic",
                               model_name="tests/tiny-model", storage_backend_extra_config=extra,
                               io_backend="direct")
    name = cc.storage_backend.name
    try:
        flat = host.kv_buffer.reshape(-1).view(torch.uint8)
        flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8))
        yield cc
    finally:
        cc.detach_storage_backend()
    assert not list_segments(name)


def backup(cc: Any, tokens: list[int]) -> tuple[torch.Tensor, list[str]]:
    """Host pages holding `tokens`' KV, written to storage by SGLang's backup thread under its own page keys."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    src = cc.mem_pool_host.alloc(len(tokens))
    hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
    op_id = cc.write_storage(src, tokens, hash_value=hashes)
    done = cc.ack_backup_queue.get(timeout=WAIT_S)
    assert done.id == op_id and done.completed_tokens == len(tokens)
    return src, hashes


def prefetch(cc: Any, tokens: list[int]) -> tuple[int, torch.Tensor | None]:
    """SGLang's prefetch of `tokens`: (tokens loaded into the host pool, their host indices)."""
    op = cc.prefetch("req", tokens)
    op.handle = "req"
    hit = cc.prefetch_hit_queue.get(timeout=WAIT_S)
    assert hit is op
    if hit.storage_hit_count == 0:
        return 0, None
    hit.host_indices = cc.mem_pool_host.alloc(hit.storage_hit_count)  # the scheduler's step
    cc.prefetch_buffer.put(hit)
    # the I/O thread acknowledges each batch it loaded (tokens so far), then the operation's end
    loaded = 0
    while not (ack := cc.ack_prefetch_queue.get(timeout=WAIT_S)).completed_req:
        assert ack.operation is op
        loaded = int(ack.completed_tokens)
    return loaded, hit.host_indices


def test_one_engine_backs_up_and_another_prefetches_through_sglangs_threads(process_group: Any,
                                                                            shared_tier: str) -> None:
    tokens = list(range(100, 100 + 4 * PAGE))
    with controller(process_group, shared_tier) as a, controller(process_group, shared_tier) as b:
        assert b.page_get_func.__name__ == "_page_get_zero_copy"  # SGLang picked the v1 path from the config
        src, _ = backup(a, tokens)
        loaded, dst = prefetch(b, tokens)
        assert loaded == len(tokens) and dst is not None
        assert [page_bytes(b.mem_pool_host, int(dst[p * PAGE])) for p in range(4)] == \
            [page_bytes(a.mem_pool_host, int(src[p * PAGE])) for p in range(4)]
        # a longer prompt (the next turn): its stored prefix is the hit, the new part is SGLang's to compute
        loaded, _ = prefetch(b, tokens + list(range(900, 900 + 2 * PAGE)))
        assert loaded == len(tokens)
        assert prefetch(b, list(range(5000, 5000 + 2 * PAGE)))[0] == 0  # another prompt: no hit
        assert b.storage_backend.kvproc_counters()["get_hit_pages"] == 8
