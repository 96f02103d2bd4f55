"""Hunt issue 39's item 2: `kvproc demo --ranks 2` where rank 1 restores other KV than rank 0 (rare).

Runs the 2-rank demo's kvproc run in this process with the reference engine instrumented: every admitted request's
per-rank prefix (device tokens, host tokens, hold pages) and block table are recorded; when the engine's lock-step
check raises "rank 1 diverged", every page of the diverging request is compared between the ranks' arenas, and the
pages that differ are printed with their block ids, generations, whether their page hashes agree, where each rank's
prefix came from, and the request's outcomes. Then the error is raised again.

    .venv/bin/python bench/rank_divergence_probe.py [--scale 0.25] [demo flags]

Seen: 1 divergence in 32 uninstrumented runs (`kvproc demo --ranks 2 --scale 0.25 --runs kvproc`, default seed, the
machine loaded by a test run), always request c8-t3 (as in the issue's 2 of 17); 0 in 47 runs of this probe, 15 of
them loaded. Run it in a loop beside a load (`make test`), until it prints `DEBUG`.
"""

from __future__ import annotations

import sys
from typing import Any

from kvproc.demo import single
from kvproc.engine import engine as E

_info: dict[str, dict[str, Any]] = {}


def _page_bytes(model: Any, rank: int, block: int) -> list[bytes]:
    out = []
    for _, arena in model.arenas(rank):
        flat = arena.tensor.view(-1)
        out.append(bytes(flat[block * arena.block_stride: block * arena.block_stride + arena.bytes_per_block].numpy()))
    return out


def _instrument() -> None:
    start, step = E.Engine._start, E.Engine.step

    def recorded_start(self: Any, r: Any) -> None:
        pre = None if r.prefixes is None else [
            (p.device_tokens, p.host_tokens, -1 if p.hold.consumed else p.hold.num_blocks) for p in r.prefixes]
        start(self, r)
        a = self._running.get(r.req.req_id)
        if a is not None:
            _info[r.req.req_id] = {"prefixes": pre, "computed": [k.num_computed for k in a.kvs]}

    def checked_step(self: Any) -> Any:
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
            if _page_bytes(engine.models[0], 0, ids[0]) != _page_bytes(engine.models[1], 1, ids[1]):
                hashes = [k.page_hashes[page] if page < len(k.page_hashes) else None for k in kvs]
                print("DEBUG page", page, "differs: blocks", ids, "generations",
                      [int(k.pool.paged.generation[b]) for k, b in zip(kvs, ids)], "hashes agree",
                      hashes[0] == hashes[1], flush=True)
        print("DEBUG outcomes", engine.store.outcomes.for_request(rid), flush=True)
        for r in (0, 1):
            print(f"DEBUG rank{r}", {k: v for k, v in engine.store.stats()[f"rank{r}"].items() if v}, flush=True)


if __name__ == "__main__":
    _instrument()
    sys.exit(single.main(["--ranks", "2", "--scale", "0.25", "--runs", "kvproc", *sys.argv[1:]]))
