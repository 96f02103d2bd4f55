"""`kvproc bench pooled`: the Mooncake conversation trace over N nodes (round robin), token hit ratio with node-local
host tiers only vs with a shared remote tier below them (the FAST'25 paper's "local vs global cache" comparison).

Each node is a `HostIndex` of `--host-tokens` capacity (LRU, kvproc's own); the remote tier is one more `HostIndex`
shared by every node (`--remote-tokens`, default: room for every page of the trace). A request on node `i % N` hits
the longest of its local host tier's prefix and the remote tier's; what the remote tier adds is pulled into the local
one (as `kvproc/tiers/mooncake.py` does), then the request's pages are saved locally and written behind to the remote
tier. No bytes move: this measures where hits come from (`kvproc bench remote` measures the bytes). Pages of
`--page-tokens` (512: the trace's own block, so an infinite pooled tier reproduces the trace's ideal, 0.3736).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from kvproc.bench.replay import DEFAULT_TRACE, TRACE_BLOCK, load_trace, synth_tokens
from kvproc.core.hashing import BlockHasher
from kvproc.tiers.host_index import Hit, HostIndex, SaveTicket


def _hit(index: HostIndex, req_id: str, hashes: list[bytes]) -> int:
    res = index.query(req_id, hashes)
    if isinstance(res, Hit):
        index.release_lease(res.lease_id)
        return res.pages
    return 0


def _save(index: HostIndex, req_id: str, hashes: list[bytes]) -> None:
    t = index.reserve_save(req_id, hashes)
    if isinstance(t, SaveTicket):
        index.commit_save(t.save_id)


def pooled(hashed: list[tuple[list[bytes], int]], nodes: int, host_pages: int, remote_pages: int | None,
           page_tokens: int) -> dict[str, Any]:
    hosts = [HostIndex(max(host_pages, 1), high_watermark=1.0) for _ in range(nodes)]
    remote = HostIndex(remote_pages, high_watermark=1.0) if remote_pages else None
    hit_tokens = local_tokens = input_tokens = 0
    for i, (hashes, input_len) in enumerate(hashed):
        host, rid = hosts[i % nodes], f"r{i}"
        local = _hit(host, rid, hashes)
        got = local
        if remote is not None and local < len(hashes):
            got = max(local, _hit(remote, rid, hashes))
            if got > local:
                _save(host, rid, hashes[:got])  # the pull lands in this node's host tier
        _save(host, rid, hashes)
        if remote is not None:
            _save(remote, rid, hashes)  # write-behind
        input_tokens += input_len
        hit_tokens += min(got * page_tokens, input_len)
        local_tokens += min(local * page_tokens, input_len)
    return {"nodes": nodes, "pooled": remote is not None, "host_tokens_per_node": host_pages * page_tokens,
            "token_hit_ratio": round(hit_tokens / max(input_tokens, 1), 4),
            "local_part": round(local_tokens / max(input_tokens, 1), 4)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvproc bench pooled", description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", default=str(DEFAULT_TRACE))
    p.add_argument("--limit", type=int, default=None, help="first N requests only")
    p.add_argument("--nodes", default="1,2,4,8")
    p.add_argument("--host-tokens", type=float, default=2e7, help="each node's host tier capacity, tokens")
    p.add_argument("--remote-tokens", type=float, default=math.inf, help="the shared tier's capacity, tokens")
    p.add_argument("--page-tokens", type=int, default=TRACE_BLOCK)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    trace = load_trace(Path(args.trace), args.limit)
    hasher = BlockHasher(args.page_tokens)
    t0 = time.perf_counter()
    hashed = [(list(hasher.hash_prompt(synth_tokens(r.hash_ids))), r.input_length) for r in trace]
    total_pages = sum(len(h) for h, _ in hashed)
    host_pages = int(min(args.host_tokens // args.page_tokens, total_pages))
    remote_pages = total_pages if math.isinf(args.remote_tokens) else int(args.remote_tokens // args.page_tokens)
    rows = []
    for n in [int(x) for x in args.nodes.split(",")]:
        for remote in (None, remote_pages):
            row = pooled(hashed, n, host_pages, remote, args.page_tokens)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{len(trace)} requests, {args.page_tokens}-token pages, host tier {host_pages * args.page_tokens:.3g} "
          f"tokens per node, shared tier {remote_pages * args.page_tokens:.3g} tokens ({time.perf_counter() - t0:.1f} s)")
    print(f"{'nodes':>5} {'local only':>11} {'pooled':>8}")
    for n in sorted({r["nodes"] for r in rows}):
        loc = next(r for r in rows if r["nodes"] == n and not r["pooled"])
        poo = next(r for r in rows if r["nodes"] == n and r["pooled"])
        print(f"{n:>5} {loc['token_hit_ratio']:>11.4f} {poo['token_hit_ratio']:>8.4f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0
