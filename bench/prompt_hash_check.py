"""What checking a resolve's hashes against the request's prompt costs (issue 15, item 3), against what it saves.

`RequestKv(prompt_hashes=prefix.page_hashes)` used to trust the hashes; it now checks them against its own tokens
(`PageHashes.covers`: the prompt packed to bytes, one comparison). Measured in the same run, per prompt size:
`hash` (what passing the hashes saves: `hash_prompt`), `check` (`covers` alone), `request_checked` (a `RequestKv`
built with the hashes), `request_hashing` (a `RequestKv` that hashes its prompt itself).

    .venv/bin/python bench/prompt_hash_check.py
"""

from __future__ import annotations

import statistics
import time

import numpy as np

from kvproc import GroupKind, GroupSpec, KvSpec, RequestKv
from kvproc.core.pool import BlockPool


def _us(fn, reps: int) -> float:
    runs = []
    for _ in range(7):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        runs.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(runs)


def main() -> None:
    pool = BlockPool(KvSpec(16, (GroupSpec("kv", GroupKind.PAGED),), model_id="bench"), 64)
    print("| prompt tokens | hash us | check us | check/hash | RequestKv checked us | RequestKv hashing us |")
    print("|---|---|---|---|---|---|")
    for n in (1025, 8193, 32769):
        toks = np.random.default_rng(0).integers(0, 50_000, n).tolist()
        hashes = pool.hasher.hash_prompt(toks)
        arr = np.asarray(toks, dtype=np.int64)
        reps = max(20, 20_000 // (n // 64))
        t_hash = _us(lambda: pool.hasher.hash_prompt(toks), reps)
        t_check = _us(lambda: hashes.covers(pool.hasher, arr, hashes.scope), reps)
        t_req_checked = _us(lambda: RequestKv(pool, "r", toks, 1, prompt_hashes=hashes), reps)
        t_req_hashing = _us(lambda: RequestKv(pool, "r", toks, 1), reps)
        print(f"| {n} | {t_hash:.1f} | {t_check:.1f} | {t_check / t_hash:.2f} | {t_req_checked:.1f} | "
              f"{t_req_hashing:.1f} |")


if __name__ == "__main__":
    main()
