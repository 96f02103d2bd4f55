"""`kvproc bench sglang`: SGLang HiCache storage backends' page set / get throughput on the same pages, in one run.

Needs SGLang installed (`make venv-sglang`; run with `.venv-sglang/bin/python -m kvproc bench sglang`). Each backend
is driven the way SGLang's cache controller drives it, through the controller's own page functions
(`HiCacheController._page_set_zero_copy` / `_page_get_zero_copy` for zero-copy backends, `_generic_page_set` /
`_generic_page_get` for the others, called with a stand-in for the controller's state), over one SGLang MHA host pool
(page-first layout, bf16). Backends:
- kvproc: `KvprocHiCacheStorage`, its own host tier (processes and shared memory on this machine), zero copy.
- file: SGLang's `HiCacheFile` in a fresh temporary directory (the OS page cache keeps the files in memory here).
- mooncake: SGLang's `MooncakeStore` against a Mooncake Store on loopback (`LocalMooncake`: a master and one
  storage node), zero copy; skipped with the reason where `mooncake-transfer-engine-non-cuda` is missing.

A set round writes every page under fresh keys (every backend skips keys it already has); a get round reads the
first round's pages into other host pages, checked bit for bit once. The median round is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import torch

COMMAND = "kvproc bench sglang"


def bench_pool(pages: int, page_tokens: int, layers: int, heads: int, head_dim: int) -> Any:
    """An SGLang MHA host pool of at least 2 * `pages` pages (a source and a destination half), random bytes."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    tokens = pages * page_tokens
    dev = MHATokenToKVPool(tokens, page_tokens, torch.bfloat16, heads, head_dim, layers, "cpu", False,
                           start_layer=0, end_layer=layers - 1)
    pool = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_tokens, "page_first",
                                pin_memory=False, device_capacity_tokens=dev.size, start_layer=0,
                                end_layer=layers - 1, write_back_staging=dev.hicache_write_back_staging)
    flat = pool.kv_buffer.reshape(-1).view(torch.uint8)
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))
    return pool


def _config(extra: dict[str, Any]) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="bench/model", extra_config=extra)


@contextlib.contextmanager
def _kvproc(pool: Any, host_bytes: int) -> Iterator[tuple[Any, bool]]:
    from kvproc.integrations.sglang.backend import KvprocHiCacheStorage

    b = KvprocHiCacheStorage(_config({"interface_v1": 1, "host_bytes": host_bytes}))
    try:
        b.register_mem_pool_host(pool)
        yield b, True
    finally:
        b.close()


@contextlib.contextmanager
def _file(pool: Any) -> Iterator[tuple[Any, bool]]:
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    with tempfile.TemporaryDirectory(prefix="kvproc-bench-hicache-") as d:
        b = HiCacheFile(_config({"file_storage_path": d}))
        b.register_mem_pool_host(pool)
        yield b, False


@contextlib.contextmanager
def _mooncake(pool: Any, segment_mb: int) -> Iterator[tuple[Any, bool]]:
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    from kvproc.tiers.mooncake_local import LocalMooncake

    with LocalMooncake.start(segment_mb=segment_mb) as mc:
        b = MooncakeStore(_config({"master_server_address": mc.master_address, "metadata_server": mc.metadata,
                                   "protocol": "tcp", "device_name": "", "local_hostname": "127.0.0.1",
                                   "global_segment_size": segment_mb << 20, "check_server": False}), pool)
        try:
            b.register_mem_pool_host(pool)
            yield b, True
        finally:
            # SGLang's close leaves the client to its destructor; closed here, while the master still answers
            b.store.close()


def _rounds(backend: Any, zero_copy: bool, pool: Any, pages: int, batch: int, rounds: int,
            name: str) -> tuple[list[float], list[float], bool]:
    """Seconds of each set round and each get round, and whether the first get came back bit for bit."""
    from sglang.srt.managers.cache_controller import HiCacheController as C

    pt = pool.page_size
    ctl = SimpleNamespace(storage_backend=backend, storage_host_pool=pool, mem_pool_host=pool, page_size=pt)
    op = SimpleNamespace(request_id="bench", is_terminated=lambda: False)
    put: Callable[..., Any] = C._page_set_zero_copy if zero_copy else C._generic_page_set
    get: Callable[..., Any] = C._page_get_zero_copy if zero_copy else C._generic_page_get
    src = torch.arange(0, pages * pt, dtype=torch.int64)
    dst = torch.arange(pages * pt, 2 * pages * pt, dtype=torch.int64)
    sets, gets, exact = [], [], True
    for r in range(rounds):
        ks = [f"{name}{r:04d}{i:060x}" for i in range(pages)]
        t = time.perf_counter()
        for i in range(0, pages, batch):
            if not put(ctl, ks[i:i + batch], src[i * pt:(i + batch) * pt]):
                raise RuntimeError(f"{name}: a set failed")
        sets.append(time.perf_counter() - t)
    first = [f"{name}{0:04d}{i:060x}" for i in range(pages)]
    for r in range(rounds):
        pool.kv_buffer[:, pages * pt:2 * pages * pt].view(torch.uint8).zero_()
        t = time.perf_counter()
        for i in range(0, pages, batch):
            n = min(batch, pages - i)
            if get(ctl, op, first[i:i + n], dst[i * pt:(i + n) * pt]) != n:
                raise RuntimeError(f"{name}: a get missed")
        gets.append(time.perf_counter() - t)
        if r == 0:
            a = pool.kv_buffer[:, :pages * pt].contiguous().view(torch.uint8)
            b = pool.kv_buffer[:, pages * pt:2 * pages * pt].contiguous().view(torch.uint8)
            exact = bool(torch.equal(a, b))
    return sets, gets, exact


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog=COMMAND, description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--pages", type=int, default=256, help="pages a round moves (default 256)")
    ap.add_argument("--page-tokens", type=int, default=32)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--batch", type=int, default=128, help="pages per backend call (SGLang's STORAGE_BATCH_SIZE)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--backends", default="kvproc,file,mooncake")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)  # SGLang's host pool copies crawl with two threads on a 2-core box (platform notes)
    pool = bench_pool(args.pages, args.page_tokens, args.layers, args.heads, args.head_dim)
    page_bytes = pool.get_dummy_flat_data_page().numel() * 2
    total = args.pages * page_bytes
    host_bytes = (args.rounds + 1) * total + (64 << 20)  # every round's pages stay: no eviction in the timed part
    makers: dict[str, Callable[[], Any]] = {
        "kvproc": lambda: _kvproc(pool, host_bytes),
        "file": lambda: _file(pool),
        "mooncake": lambda: _mooncake(pool, max(256, 2 * (host_bytes >> 20))),
    }
    rows: dict[str, tuple[float, float, bool]] = {}
    for name in args.backends.split(","):
        try:
            with makers[name]() as (b, zero_copy):
                sets, gets, exact = _rounds(b, zero_copy, pool, args.pages, args.batch, args.rounds, name)
        except Exception as e:  # noqa: BLE001 - one backend that cannot run is reported, the others still run
            print(f"{name}: not measured: {type(e).__name__}: {e}", file=sys.stderr)
            continue
        rows[name] = (total / statistics.median(sets) / 1e9, total / statistics.median(gets) / 1e9, exact)
    print(f"command: {COMMAND} {shlex.join(argv)}")
    print(f"{args.pages} pages of {page_bytes >> 10} KiB ({args.page_tokens} tokens, {args.layers} layers, "
          f"{args.heads} heads x {args.head_dim}, bf16, page_first), {args.batch} pages a call, median of "
          f"{args.rounds} rounds\n")
    print("| backend | set GB/s | get GB/s | set vs file | get vs file | set vs mooncake | get vs mooncake | bit-exact |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (s, g, exact) in rows.items():
        def ratio(other: str, i: int, v: float) -> str:
            return f"{v / rows[other][i]:.2f}x" if other in rows else "-"
        print(f"| {name} | {s:.2f} | {g:.2f} | {ratio('file', 0, s)} | {ratio('file', 1, g)} | "
              f"{ratio('mooncake', 0, s)} | {ratio('mooncake', 1, g)} | {'yes' if exact else 'NO'} |")
    return 0 if rows and all(e for _, _, e in rows.values()) else 1
