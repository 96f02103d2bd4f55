"""Threaded fuzz of the admission floor: opportunistic reservers race one admitting scheduler.

Reference design section 5: admission reserves a request's whole lifetime and opportunistic reservations only take
blocks above `entitled`, both under the pool lock, so an admitted request's page draw can never fail however restores
interleave with it. The reservers here probe, reserve, commit loaded blocks into their holds (racing the scheduler's
own sealing of the same pages) or abort, and drop handles for the GC path; the switch interval is shortened so the
interpreter swaps threads inside pool operations' Python code as often as it can.
"""

from __future__ import annotations

import gc
import random
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from kvproc import (
    BlockPool,
    GroupKind,
    GroupSpec,
    KvSpec,
    PoolExhaustedError,
    RequestKv,
)

P = 4
NUM_BLOCKS = 36
TARGET_LIFECYCLES = 4000
TIME_LIMIT_S = 8.0
RESERVERS = 3
MAX_ACTIVE = 4
SPEC = KvSpec(P, (GroupSpec("kv", GroupKind.PAGED),))


@dataclass
class Shared:
    stop: threading.Event = field(default_factory=threading.Event)
    failures: list[str] = field(default_factory=list)
    reserves: int = 0
    commits: int = 0
    declined: int = 0


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    # A few shared heads with short, low-entropy tails: reservers and the scheduler keep loading and sealing the
    # same pages, which drives commit_loaded_blocks down its "someone else sealed it first" path.
    heads = [list(range(1000 * h, 1000 * h + 16)) for h in range(4)]
    return [rng.choice(heads)[: rng.choice((4, 8, 16))] + [rng.randrange(4) for _ in range(rng.randrange(1, 24))]
            for _ in range(n)]


def _reserver(pool: BlockPool, seed: int, prompts: list[tuple[list[int], list[bytes]]], sh: Shared) -> None:
    rng = random.Random(seed)
    try:
        while not sh.stop.is_set():
            tokens, hashes = rng.choice(prompts)
            hold = pool.probe(hashes, len(tokens))
            k = hold.num_blocks
            cap = (len(tokens) - 1) // P
            n = rng.randint(1, max(1, cap - k)) if cap > k else rng.randint(1, 6)
            res = pool.reserve_loaded_blocks(n)
            if res is None:
                sh.declined += 1
            else:
                sh.reserves += 1
                if k + n <= cap and rng.random() < 0.6:
                    pool.commit_loaded_blocks(res, hold, hashes[k : k + n])
                    sh.commits += 1
                elif rng.random() < 0.5:
                    res.release()
                else:
                    del res  # the GC path: the next locked pool operation drains it
            if rng.random() < 0.8:
                hold.release()
            del hold
    except Exception as e:  # noqa: BLE001 - any error in a reserver is a test failure, reported by the main thread
        sh.failures.append(f"reserver {seed}: {type(e).__name__}: {e}")
        sh.stop.set()


@dataclass
class Running:
    kv: RequestKv
    max_out: int
    outputs: int = 0


def _scheduler(pool: BlockPool, prompts: list[tuple[list[int], list[bytes]]], sh: Shared) -> tuple[int, int]:
    """Create, admit (crediting the probe's hold), run to completion and release requests; returns (completed,
    rejected). A PoolExhaustedError from an admitted request's schedule is the failure under test."""
    rng = random.Random(7)
    active: list[Running] = []
    completed = rejected = 0
    deadline = time.monotonic() + TIME_LIMIT_S
    while completed < TARGET_LIFECYCLES and time.monotonic() < deadline and not sh.stop.is_set():
        if len(active) < MAX_ACTIVE:
            tokens, hashes = rng.choice(prompts)
            max_out = rng.randrange(0, 12)
            kv = RequestKv(pool, f"r{completed + rejected}", tokens, max_out, prompt_hashes=hashes)
            hold = pool.probe(hashes, len(tokens))
            if kv.try_admit(credited=hold.num_blocks):
                kv.match_and_add_prefix(hold)
                active.append(Running(kv, max_out))
            else:
                hold.release()
                kv.release()
                rejected += 1
        for r in list(active):
            kv = r.kv
            left = kv.num_tokens - kv.num_computed
            try:
                kv.schedule(min(left, rng.choice((1, 4, 8, 32))))
            except PoolExhaustedError as e:
                sh.failures.append(f"admitted draw failed: {e} (available={pool.available}, entitled={pool.entitled})")
                sh.stop.set()
                return completed, rejected
            if rng.random() < 0.05:
                kv.revert()
                continue
            kv.apply()
            if kv.num_computed == kv.num_tokens:
                if r.outputs < r.max_out:
                    kv.append_tokens([rng.randrange(4)])  # the sampled token; the next step computes it
                    r.outputs += 1
                else:
                    active.remove(r)
                    kv.release()
                    completed += 1
        with pool.lock:
            if pool.available < pool.entitled:
                sh.failures.append(f"floor broken: available={pool.available} < entitled={pool.entitled}")
                sh.stop.set()
    for r in active:
        r.kv.release()
    return completed, rejected


def test_admitted_draw_never_fails_under_concurrent_reserves() -> None:
    pool = BlockPool(SPEC, NUM_BLOCKS)
    rng = random.Random(1)
    prompts = [(t, pool.hasher.hash_prompt(t)) for t in _prompts(rng, 64)]
    sh = Shared()
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        threads = [
            threading.Thread(target=_reserver, args=(pool, 100 + i, prompts, sh), daemon=True) for i in range(RESERVERS)
        ]
        for t in threads:
            t.start()
        completed, rejected = _scheduler(pool, prompts, sh)
        sh.stop.set()
        for t in threads:
            t.join(timeout=10)
            assert not t.is_alive()
    finally:
        sys.setswitchinterval(old_interval)
    assert not sh.failures, sh.failures[:5]
    gc.collect()
    pool.drain_deferred()
    # It really was a race: enough lifecycles, reservations granted and declined, loads committed.
    assert completed >= 300, (completed, rejected)
    assert sh.reserves > 100 and sh.commits > 50 and sh.declined > 0 and rejected > 0, (sh.reserves, sh.commits, sh.declined, rejected)
    assert pool.entitled == 0 and pool.recompute_entitled() == 0
    assert not pool.paged.refcount.any()
    state = pool.paged.state_of()
    assert not state["active"]
    assert state["free"] | state["inactive"] == set(range(NUM_BLOCKS))
    assert not state["free"] & state["inactive"]
    assert np.all(pool.paged.hashed[sorted(state["inactive"])])
