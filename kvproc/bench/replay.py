"""`kvproc bench replay`: replay a Mooncake-format trace through kvproc's real hashing, pool, index and host index.

Each request goes through the path a real prompt takes: synthesise tokens -> hash -> probe the device pool -> ask the
host index for the rest (and "restore" it: reserve + commit into the pool) -> admit -> allocate (schedule/apply:
pages sealed in place) -> save the sealed pages to the host index (two-phase) -> release. KV bytes are not moved (this
benchmark measures the index work and hit ratios; `kvproc bench copy` measures bytes).

Semantics, chosen to match how the trace's own paper counts hits:
- Block id b of the trace names 512 tokens derived from b alone (a vectorised mix of b and the position), so equal
  ids give equal tokens; a request's prompt is the full 512-token blocks of its ids (the last block is not cut to
  `input_length`); hit tokens are counted up to `input_length`, hit blocks as whole 512-token blocks.
- `full_pages` reuse policy (no one-token reuse cap), requests one at a time in trace order, output tokens not
  generated (they never match a later prompt in this trace and the paper's simulation does not store them).
- The device pool can never be smaller than the largest single request (it could not admit it); the effective
  device capacity is reported.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from kvproc.contract import GroupKind, GroupSpec, KvSpec
from kvproc.core.eviction import DEFAULT_HALF_LIFE_S, POLICIES
from kvproc.core.hashing import DEFAULT_HASH, BlockHasher, HashAlgorithm
from kvproc.core.holds import ReusePolicy
from kvproc.core.pool import BlockPool
from kvproc.core.request_kv import RequestKv
from kvproc.tiers.host_index import Hit, HostIndex, SaveTicket

TRACE_BLOCK = 512
VOCAB = 32000
DEFAULT_TRACE = Path(__file__).resolve().parents[2].parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


@dataclass(frozen=True)
class TraceRequest:
    timestamp: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_trace(path: Path, limit: int | None = None) -> list[TraceRequest]:
    out: list[TraceRequest] = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            r = json.loads(line)
            out.append(TraceRequest(r["timestamp"], r["input_length"], r["output_length"], tuple(r["hash_ids"])))
            if limit is not None and len(out) >= limit:
                break
    return out


_POS = np.arange(TRACE_BLOCK, dtype=np.uint64)


def synth_tokens(hash_ids: tuple[int, ...]) -> np.ndarray:
    """512 token ids per trace block, a pure function of (block id, position): one vectorised splitmix round."""
    b = np.asarray(hash_ids, dtype=np.uint64)[:, None]
    x = b * np.uint64(0x9E3779B97F4A7C15) + _POS[None, :] * np.uint64(0xBF58476D1CE4E5B9) + np.uint64(1)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(29)
    return (x % np.uint64(VOCAB)).astype(np.int32).reshape(-1)


@dataclass
class ReplayResult:
    requests: int
    block_hit_ratio: float
    token_hit_ratio: float
    device_hit_ratio: float
    host_hit_ratio: float
    requests_per_s: float
    cpu_requests_per_s: float  # by this process's CPU time: steadier than wall time on a shared machine
    blocks_per_s: float
    pages_per_s: float
    effective_device_tokens: int
    host_tokens: int | None
    peak_rss_mib: float
    hash: str
    page_tokens: int

    def to_json(self) -> dict[str, object]:
        return dict(self.__dict__)


def _capacity(value: str) -> float:
    return math.inf if value.lower() in ("inf", "infinite", "none") else float(value)


def replay(
    trace: list[TraceRequest],
    *,
    page_tokens: int = 16,
    device_tokens: float = math.inf,
    host_tokens: float = 0,
    algorithm: HashAlgorithm = DEFAULT_HASH,
    progress: bool = False,
    eviction: str = "lru",
) -> ReplayResult:
    if TRACE_BLOCK % page_tokens:
        raise ValueError(f"--page-tokens must divide {TRACE_BLOCK}, got {page_tokens}")
    pages_per_block = TRACE_BLOCK // page_tokens
    largest = max(len(r.hash_ids) for r in trace) * pages_per_block
    total_pages = sum(len(r.hash_ids) for r in trace) * pages_per_block
    # A pool larger than every page the trace holds behaves like an infinite one: cap it there.
    dev_blocks = total_pages if math.isinf(device_tokens) else max(int(device_tokens) // page_tokens, largest)
    dev_blocks = min(dev_blocks, total_pages)
    spec = KvSpec(page_tokens, (GroupSpec("kv", GroupKind.PAGED),))
    hasher = BlockHasher(page_tokens, algorithm)
    pool = BlockPool(spec, max(dev_blocks, 1), hasher=hasher, eviction=eviction)
    host: HostIndex | None = None
    if host_tokens:
        slots = total_pages if math.isinf(host_tokens) else max(min(int(host_tokens) // page_tokens, total_pages), 1)
        host = HostIndex(slots, high_watermark=1.0, eviction=eviction)

    hit_blocks = total_blocks = 0
    dev_tokens_hit = host_tokens_hit = input_tokens = 0
    synth_s = synth_cpu = 0.0  # prompt synthesis is the benchmark's, not kvproc's: excluded from the throughput
    t0, c0 = time.perf_counter(), time.process_time()
    for i, req in enumerate(_progress(trace, progress)):
        ts, cs = time.perf_counter(), time.process_time()
        tokens = synth_tokens(req.hash_ids)
        synth_s += time.perf_counter() - ts
        synth_cpu += time.process_time() - cs
        hashes = hasher.hash_prompt(tokens)
        n = len(hashes)
        hold = pool.probe(hashes, len(tokens), ReusePolicy.FULL_PAGES)
        dev_pages = hold.num_blocks
        host_pages = 0
        if host is not None and dev_pages < n:
            res = host.query(f"r{i}", hashes[dev_pages:])
            if isinstance(res, Hit):
                reservation = pool.reserve_loaded_blocks(res.pages)
                if reservation is not None:
                    pool.commit_loaded_blocks(reservation, hold, hashes[dev_pages : dev_pages + res.pages])
                    host_pages = res.pages
                host.release_lease(res.lease_id)
        kv = RequestKv(pool, f"r{i}", tokens, 0, prompt_hashes=hashes)
        if not kv.try_admit(hold.num_blocks):
            raise RuntimeError(f"request {i} not admitted into an idle pool (pool smaller than one request?)")
        kv.match_and_add_prefix(hold)
        if kv.num_computed < n * page_tokens:
            kv.schedule(n * page_tokens - kv.num_computed)
            kv.apply()
        if host is not None:
            ticket = host.reserve_save(f"r{i}", hashes)
            if isinstance(ticket, SaveTicket):
                host.commit_save(ticket.save_id)
        kv.release()
        hit_pages = dev_pages + host_pages
        hit_blocks += hit_pages // pages_per_block
        total_blocks += len(req.hash_ids)
        input_tokens += req.input_length
        dev_tokens_hit += min(dev_pages * page_tokens, req.input_length)
        host_tokens_hit += min(hit_pages * page_tokens, req.input_length) - min(dev_pages * page_tokens,
                                                                                 req.input_length)
    dt = time.perf_counter() - t0 - synth_s
    dt_cpu = time.process_time() - c0 - synth_cpu
    return ReplayResult(
        requests=len(trace),
        block_hit_ratio=hit_blocks / max(total_blocks, 1),
        token_hit_ratio=(dev_tokens_hit + host_tokens_hit) / max(input_tokens, 1),
        device_hit_ratio=dev_tokens_hit / max(input_tokens, 1),
        host_hit_ratio=host_tokens_hit / max(input_tokens, 1),
        requests_per_s=len(trace) / dt,
        cpu_requests_per_s=len(trace) / dt_cpu,
        blocks_per_s=total_blocks / dt,
        pages_per_s=total_blocks * pages_per_block / dt,
        effective_device_tokens=pool.paged.num_blocks * page_tokens,
        host_tokens=None if host is None else host.page_slots * page_tokens,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        hash=algorithm.value,
        page_tokens=page_tokens,
    )


def _progress(trace: list[TraceRequest], enabled: bool) -> Iterator[TraceRequest]:
    n = len(trace)
    step = max(n // 50, 1)
    for i, r in enumerate(trace):
        if enabled and i % step == 0:
            print(f"\r  replay [{'#' * (i * 30 // n):<30}] {i}/{n}", end="", file=sys.stderr, flush=True)
        yield r
    if enabled:
        print(f"\r  replay [{'#' * 30}] {n}/{n}", file=sys.stderr)


# Mooncake FAST'25, conversation trace, pure LRU with one global pool (read off the paper's figure).
PAPER_POINTS = {1e6: 0.09, 3e6: 0.165, 1e7: 0.325, 5e7: 0.40}
SWEEP = (1e4, 1e5, 3e5, 1e6, 3e6, 1e7, 3e7, 5e7, 1e8)


def sweep(trace: list[TraceRequest], args: argparse.Namespace) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for cap in SWEEP:
        r = replay(trace, page_tokens=args.page_tokens, device_tokens=cap, host_tokens=0,
                   algorithm=HashAlgorithm(args.hash))
        rows.append({"capacity_tokens": cap, "effective_device_tokens": r.effective_device_tokens,
                     "block_hit_ratio": r.block_hit_ratio, "token_hit_ratio": r.token_hit_ratio,
                     "paper": PAPER_POINTS.get(cap), "requests_per_s": r.requests_per_s})
        print(f"  capacity {cap:>8.0e} tokens: block hit {r.block_hit_ratio:.4f}  token hit {r.token_hit_ratio:.4f}"
              f"  paper {PAPER_POINTS.get(cap, float('nan')):.3f}", file=sys.stderr)
    return rows


def _plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [float(r["capacity_tokens"]) for r in rows]
    ax.plot(xs, [r["block_hit_ratio"] for r in rows], "o-", label="kvproc (block hit ratio)")
    ax.plot(list(PAPER_POINTS), list(PAPER_POINTS.values()), "s--", label="Mooncake FAST'25 (read off figure)")
    ax.set_xscale("log")
    ax.set_xlabel("cache capacity (tokens)")
    ax.set_ylabel("prefix hit ratio")
    ax.set_title("Mooncake conversation trace: hit ratio vs capacity")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _compare_policies(args: argparse.Namespace) -> int:
    from kvproc.bench.eviction_sim import compare, format_rows
    from kvproc.bench.synthetic_trace import synthetic_trace

    traces: dict[str, list[TraceRequest]] = {}
    for name in args.traces.split(","):
        if name == "conversation":
            traces[name] = load_trace(args.trace, args.limit)
        elif name == "synthetic":
            traces[name] = synthetic_trace(requests=args.limit or 12000)
        else:
            print(f"kvproc bench replay: unknown trace {name!r} (conversation, synthetic)", file=sys.stderr)
            return 2
    policies = args.policy.split(",")
    for p in policies:
        if p != "belady" and p not in POLICIES:
            print(f"kvproc bench replay: unknown policy {p!r}", file=sys.stderr)
            return 2
    capacities = [_capacity(c) for c in args.capacity.split(",")]
    if args.hint:
        from kvproc.bench.hint_replay import compare_hinted, parse_hint

        try:
            hint = parse_hint(args.hint)
        except ValueError as e:
            print(f"kvproc bench replay: {e}", file=sys.stderr)
            return 2
        rows = compare_hinted(traces, capacities, policies, hint)
        print(f"online rows through the host tier's index (HostIndex); hint {hint.label}")
    else:
        rows = compare(traces, capacities, policies, half_life=args.half_life)
    print(format_rows(rows))
    if args.json:
        Path(args.json).write_text(json.dumps({"policies": rows}, indent=2))
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvproc bench replay", description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    ap.add_argument("--page-tokens", type=int, default=16)
    ap.add_argument("--device-tokens", type=_capacity, default=math.inf)
    ap.add_argument("--host-tokens", type=_capacity, default=0.0)
    ap.add_argument("--bytes-per-token", type=int, default=0,
                    help="KV bytes per token (reported only: this benchmark counts capacity in tokens)")
    ap.add_argument("--hash", choices=[a.value for a in HashAlgorithm], default=DEFAULT_HASH.value)
    ap.add_argument("--sweep", action="store_true", help="hit ratio against capacity, 1e4..1e8 tokens")
    ap.add_argument("--plot", default=None, help="PNG path for --sweep")
    ap.add_argument("--json", default=None)
    ap.add_argument("--capacity", default=None,
                    help="eviction comparison: capacities in tokens (e.g. 1e6,3e6,1e7), 512-token blocks "
                         "(kvproc/bench/eviction_sim.py), on the conversation and the synthetic trace")
    ap.add_argument("--policy", default="lru,lfu,lrfu,belady",
                    help=f"with --capacity: policies ({','.join(POLICIES)},belady)")
    ap.add_argument("--half-life", type=float, default=DEFAULT_HALF_LIFE_S,
                    help="lrfu's half-life, seconds of trace time")
    ap.add_argument("--traces", default="conversation,synthetic", help="with --capacity: which traces")
    ap.add_argument("--hint", default=None,
                    help="with --capacity: replay each online policy through the host tier's index without and with "
                         "a retention hint derived from the trace, within=S[,retain=S][,noise=F]: a request's save "
                         "carries retain_s=retain (default S) when its conversation comes back within S seconds "
                         "(kvproc/bench/hint_replay.py)")
    ap.add_argument("--eviction", default="lru", choices=POLICIES,
                    help="the device pool's and host index's eviction policy in the full replay")
    ap.add_argument("--vs-vllm", action="store_true",
                    help="also replay the same trace through vLLM v1's KVCacheManager (in .venv-vllm), same run")
    ap.add_argument("--vllm-python", type=Path, default=Path(__file__).resolve().parents[2] / ".venv-vllm/bin/python")
    args = ap.parse_args(argv)
    if not args.trace.exists():
        print(f"kvproc bench replay: trace not found: {args.trace}", file=sys.stderr)
        return 2
    if args.capacity:
        return _compare_policies(args)
    trace = load_trace(args.trace, args.limit)
    if args.sweep:
        rows = sweep(trace, args)
        print(f"{'capacity':>10} {'effective':>10} {'block hit':>10} {'token hit':>10} {'paper':>7}")
        for r in rows:
            paper = r["paper"]
            print(f"{r['capacity_tokens']:>10.0e} {r['effective_device_tokens']:>10} {r['block_hit_ratio']:>10.4f} "
                  f"{r['token_hit_ratio']:>10.4f} {paper if paper is not None else '':>7}")
        if args.plot:
            _plot(rows, args.plot)
            print(f"plot written to {args.plot}")
        if args.json:
            Path(args.json).write_text(json.dumps({"sweep": rows}, indent=2))
        return 0
    res = replay(trace, page_tokens=args.page_tokens, device_tokens=args.device_tokens,
                 host_tokens=args.host_tokens, algorithm=HashAlgorithm(args.hash), progress=sys.stderr.isatty(),
                 eviction=args.eviction)
    print(f"requests {res.requests}  page {res.page_tokens}  hash {res.hash}")
    print(f"  block hit ratio {res.block_hit_ratio:.4f}   token hit ratio {res.token_hit_ratio:.4f} "
          f"(device {res.device_hit_ratio:.4f}, host {res.host_hit_ratio:.4f})")
    print(f"  {res.requests_per_s:,.0f} requests/s   {res.blocks_per_s:,.0f} trace blocks/s   "
          f"{res.pages_per_s:,.0f} pages/s   peak RSS {res.peak_rss_mib:,.0f} MiB   "
          f"({res.cpu_requests_per_s:,.0f} requests per CPU second)")
    out = res.to_json()
    if args.vs_vllm:
        from kvproc.bench.vs_vllm import run_vllm

        v = run_vllm(args.vllm_python, args.trace, args.limit, HashAlgorithm(args.hash))
        ratio = res.requests_per_s / v["requests_per_s"]
        cpu_ratio = res.cpu_requests_per_s / v["cpu_requests_per_s"]
        print(f"  vLLM v1 KVCacheManager ({v['hash']}): {v['requests_per_s']:,.0f} requests/s "
              f"({v['cpu_requests_per_s']:,.0f} per CPU second), token hit ratio {v['token_hit_ratio']:.4f}   "
              f"kvproc ({res.hash}, {args.eviction}) / vLLM: {ratio:.2f}x (by CPU time {cpu_ratio:.2f}x)")
        out.update(vllm=v, vs_vllm=ratio, vs_vllm_cpu=cpu_ratio)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0
