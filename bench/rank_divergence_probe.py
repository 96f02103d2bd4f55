"""Issue 39's item 2: `kvproc demo --ranks 2` where rank 1 restores other KV than rank 0 (rare). Found with this.

Runs the 2-rank demo's kvproc run in this process with the reference engine instrumented: every admitted request's
per-rank prefix (device tokens, host tokens, hold pages), and each block's last events (reserved for a load, loaded,
pinned by a save, computable by a request) are recorded; when the engine's lock-step check raises "rank 1 diverged",
every page of the request that differs between the ranks' arenas is printed with its block ids, generations, whether
its page hashes agree, how far apart its float32 values are, and both blocks' trails. At exit it prints how many
steps the ranks were float rounding apart (`Engine.counters["rank_rounding_apart"]`: the engine goes on since).

    .venv/bin/python bench/rank_divergence_probe.py [--scale 0.25] [demo flags]

Measured (issue 39, the machine loaded by two other sessions' tests): 3 divergences in 92 runs before the fix, all
request c8-t3, pages 15-16 of its prefix: rank 0 loaded them from its host tier, rank 1 had them on its device; the
hashes agree and the float32 values differ by at most 1.2e-6 on values up to 4 (1413 and 3625 of 6144 values): two
computations of the same tokens in different batches, not another prompt's bytes. Since the engine tolerates
rounding (`LOCK_STEP_TOLERANCE`), 0 failed runs.
"""

from __future__ import annotations

import sys
from typing import Any

from kvproc.core import pool as P
from kvproc.demo import single
from kvproc.engine import engine as E

_info: dict[str, dict[str, Any]] = {}
# (pool serial, block) -> the last events that wrote or read it: what each block held, and since when
_trail: dict[tuple[int, int], list[str]] = {}
_clock = {"step": 0}


def _note(pool: Any, ids: Any, what: str) -> None:
    for b in ids:
        t = _trail.setdefault((pool.serial, int(b)), [])
        t.append(f"s{_clock['step']}:{what}")
        del t[:-8]


def _page_bytes(model: Any, block: int) -> list[bytes]:
    out = []
    for _, arena in model.arenas(0):  # each rank's tiny model is a whole model of its own (its rank 0)
        flat = arena.tensor.view(-1)
        out.append(bytes(flat[block * arena.block_stride: block * arena.block_stride + arena.bytes_per_block].numpy()))
    return out


def _instrument() -> None:
    start, step = E.Engine._start, E.Engine.step
    commit, pin, reserve = P.BlockPool.commit_loaded_blocks, P.BlockPool.pin, P.BlockPool.reserve_loaded_blocks

    def noted_commit(self: Any, reservation: Any, hold: Any, hashes: Any) -> None:
        ids = list(reservation.block_ids)
        commit(self, reservation, hold, hashes)
        _note(self, ids, f"loaded[{len(ids)}] after hold of {hold.num_blocks if not hold.consumed else '?'}")

    def noted_reserve(self: Any, n: int, *a: Any, **k: Any) -> Any:
        res = reserve(self, n, *a, **k)
        if res is not None:
            _note(self, res.block_ids, f"reserved[{n}]")
        return res

    def noted_pin(self: Any, ids: Any, *a: Any, **k: Any) -> Any:
        _note(self, ids, "pinned(save)")
        return pin(self, ids, *a, **k)

    P.BlockPool.commit_loaded_blocks = noted_commit  # type: ignore[method-assign]
    P.BlockPool.reserve_loaded_blocks = noted_reserve  # type: ignore[method-assign]
    P.BlockPool.pin = noted_pin  # type: ignore[method-assign]

    def recorded_start(self: Any, r: Any) -> None:
        pre = None if r.prefixes is None else [
            (p.device_tokens, p.host_tokens, -1 if p.hold.consumed else p.hold.num_blocks) for p in r.prefixes]
        start(self, r)
        a = self._running.get(r.req.req_id)
        if a is not None:
            _info[r.req.req_id] = {"prefixes": pre, "computed": [k.num_computed for k in a.kvs]}

    def checked_step(self: Any) -> Any:
        _clock["step"] += 1
        for a in list(self._running.values()):
            for k in a.kvs:  # pages this step may compute into (the decode's, or a prefill chunk's)
                P_ = self.page_tokens
                first = k.num_computed // P_
                _note(k.pool, k.block_ids[first: first + 1 + self.chunk_tokens // P_], f"computable by {a.req.req_id}")
        try:
            return step(self)
        except RuntimeError as e:
            if "diverged" in str(e):
                _report(self, str(e))
            raise

    E.Engine._start = recorded_start  # type: ignore[method-assign]
    E.Engine.step = checked_step  # type: ignore[method-assign]


def _report(engine: Any, error: str) -> None:
    for rid in [x for x in _info if f"'{x}'" in error]:
        a = engine._running.get(rid)
        if a is None:
            continue
        kvs = a.kvs
        print("DEBUG", rid, "prefix per rank (device, host, pages):", _info[rid]["prefixes"], "computed at admission",
              _info[rid]["computed"], "now", [k.num_computed for k in kvs], flush=True)
        for page in range(min(len(k.block_ids) for k in kvs)):
            ids = [k.block_ids[page] for k in kvs]
            if _page_bytes(engine.models[0], ids[0]) != _page_bytes(engine.models[1], ids[1]):
                hashes = [k.page_hashes[page] if page < len(k.page_hashes) else None for k in kvs]
                print("DEBUG page", page, "differs: blocks", ids, "generations",
                      [int(k.pool.paged.generation[b]) for k, b in zip(kvs, ids)], "hashes agree",
                      hashes[0] == hashes[1], flush=True)
                import numpy as np
                a0 = np.frombuffer(b"".join(_page_bytes(engine.models[0], ids[0])), dtype=np.float32)
                a1 = np.frombuffer(b"".join(_page_bytes(engine.models[1], ids[1])), dtype=np.float32)
                print("DEBUG   float32 view: max |diff|", float(np.abs(a0 - a1).max()), "max |value|",
                      float(np.abs(a0).max()), "values differing", int((a0 != a1).sum()), "of", a0.size, flush=True)
                for k, b in zip(kvs, ids):
                    print("DEBUG   trail", k.pool.label, b, _trail.get((k.pool.serial, b)), flush=True)
        print("DEBUG outcomes", engine.store.outcomes.for_request(rid), flush=True)
        for r in (0, 1):
            print(f"DEBUG rank{r}", {k: v for k, v in engine.store.stats()[f"rank{r}"].items() if v}, flush=True)


def _count_rounding() -> None:
    """Each engine's steps whose ranks were float rounding apart (the engine goes on: `Engine._check_lock_step`)."""
    init = E.Engine.__init__
    engines: list[Any] = []

    def kept(self: Any, *a: Any, **k: Any) -> None:
        init(self, *a, **k)
        engines.append(self)

    E.Engine.__init__ = kept  # type: ignore[method-assign]
    import atexit

    atexit.register(lambda: print("ROUNDING_APART_STEPS", sum(e.counters["rank_rounding_apart"] for e in engines),
                                  flush=True))


if __name__ == "__main__":
    _instrument()
    _count_rounding()
    sys.exit(single.main(["--ranks", "2", "--scale", "0.25", "--runs", "kvproc", *sys.argv[1:]]))
