"""Where a trace replay request's CPU time goes, per pool call (issue 35): the loop of `kvproc bench replay` (unbounded
device pool, 16-token pages, the default hash (sha256-128), lru) with a CPU timer around each step; prints requests per CPU second
(prompt synthesis excluded) and microseconds per request of each step.

Usage (from a source tree with its native module built): `.venv/bin/python bench/replay_steps.py [--limit N]`.
"""

from __future__ import annotations

import argparse
import time

from kvproc.bench.replay import DEFAULT_TRACE, load_trace, synth_tokens
from kvproc.contract import GroupKind, GroupSpec, KvSpec
from kvproc.core.hashing import DEFAULT_HASH, BlockHasher
from kvproc.core.holds import ReusePolicy
from kvproc.core.pool import BlockPool
from kvproc.core.request_kv import RequestKv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--limit", type=int, default=None)
    args = ap.parse_args()
    trace = load_trace(args.trace, args.limit)
    page = 16
    spec = KvSpec(page, (GroupSpec("kv", GroupKind.PAGED),))
    hasher = BlockHasher(page, DEFAULT_HASH)
    pool = BlockPool(spec, sum(len(r.hash_ids) for r in trace) * 512 // page, hasher=hasher)
    steps = ["hash", "probe", "init", "admit", "adopt", "schedule", "apply", "release"]
    spent = dict.fromkeys(steps, 0.0)
    clock = time.process_time
    for i, req in enumerate(trace):
        tokens = synth_tokens(req.hash_ids)
        t = [clock()]
        hashes = hasher.hash_prompt(tokens)
        t.append(clock())
        hold = pool.probe(hashes, len(tokens), ReusePolicy.FULL_PAGES)
        t.append(clock())
        kv = RequestKv(pool, f"r{i}", tokens, 0, prompt_hashes=hashes)
        t.append(clock())
        kv.try_admit(hold.num_blocks)
        t.append(clock())
        kv.match_and_add_prefix(hold)
        t.append(clock())
        todo = len(hashes) * page - kv.num_computed
        if todo > 0:
            kv.schedule(todo)
        t.append(clock())
        if todo > 0:
            kv.apply()
        t.append(clock())
        kv.release()
        t.append(clock())
        for k, name in enumerate(steps):
            spent[name] += t[k + 1] - t[k]
    n = len(trace)
    print(f"{n / sum(spent.values()):,.0f} requests per CPU second; us per request: "
          + ", ".join(f"{k} {v / n * 1e6:.1f}" for k, v in spent.items()))


if __name__ == "__main__":
    main()
