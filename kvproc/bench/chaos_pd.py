"""`kvproc bench chaos-pd`: P/D under tier stalls. The reference engine's P/D router (a prefill engine and a decode
engine, each with its own store) over one shared `kvproc up` host tier, while the tier is SIGSTOPped again and again
(each stall longer than the stores' heartbeat liveness: they call it dead, hand-offs come short, saves are shed).

Round after round (each its own seeded workload) until `--duration` passes, every turn's tokens are compared with one
engine alone on the same workload. A short hand-off is computed by the decode engine (`Engine(short_handoff=
"recompute")`): a slower turn, never a failed one. Reported: turns, failed turns, wrong outputs (target: 0 and 0),
hand-offs recomputed, stalls, and what the tier holds once the stalls are over (open leases, saves and hand-offs:
each should be 0, or ended by its release, not by a TTL).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kvproc.engine.engine import Engine
from kvproc.engine.models import build_model
from kvproc.engine.pd import PdRouter
from kvproc.engine.workload import WorkloadSpec, drive
from kvproc.runtime import manifest as mf
from kvproc.store.build import build_local_store
from kvproc.store.cluster import ClusterStore

BLOCKS, LIVE, STAGING, PAGE = 96, 4, 16, 16


@dataclass
class Summary:
    rounds: int = 0
    turns: int = 0
    failed_turns: int = 0
    wrong_outputs: int = 0
    stalls: int = 0
    handoffs_completed: int = 0
    handoffs_recomputed: int = 0
    tier_after: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.failed_turns == 0 and self.wrong_outputs == 0


def _attach(cs: ClusterStore, model_name: str, **kw: Any) -> Engine:
    model = build_model(model_name, num_blocks=BLOCKS, num_slots=LIVE + STAGING, page_tokens=PAGE, seed=0,
                        allocator=cs.allocator)
    store = cs.attach_model(model, live_slots=LIVE)
    return Engine(model, store, max_batch=LIVE, chunk_tokens=64, checkpoint_every_pages=2, **kw)


def _one_engine(model_name: str, spec: WorkloadSpec) -> dict[tuple[int, int], tuple[int, ...]]:
    model = build_model(model_name, num_blocks=BLOCKS, num_slots=LIVE + STAGING, page_tokens=PAGE, seed=0)
    store = build_local_store(model, live_slots=LIVE, host_bytes=32 << 20)
    try:
        recs = drive(Engine(model, store, max_batch=LIVE, chunk_tokens=64, checkpoint_every_pages=2), spec,
                     model.vocab_size)
    finally:
        store.close()
    return {(r.conversation, r.turn): r.output for r in recs}


class _Staller:
    """SIGSTOP the tier for `stop_s` (jittered) every `every_s` (jittered), on a thread, until stopped."""

    def __init__(self, pid: int, every_s: float, stop_s: float, seed: int) -> None:
        self.pid, self.every_s, self.stop_s = pid, every_s, stop_s
        self.rng = random.Random(seed)
        self.stalls = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-pd-staller", daemon=True)

    def __enter__(self) -> _Staller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._done.wait(self.every_s * self.rng.uniform(0.5, 1.5)):
            os.kill(self.pid, signal.SIGSTOP)
            self.stalls += 1
            try:
                self._done.wait(self.stop_s * self.rng.uniform(0.6, 1.0))
            finally:
                os.kill(self.pid, signal.SIGCONT)  # always: never leave the tier stopped


def run(duration_s: float, model_name: str, every_s: float, stop_s: float, seed: int,
        progress: bool = True) -> Summary:
    out = Summary()
    counters: Counter[str] = Counter()
    rd = tempfile.mkdtemp(prefix="kvproc-chaospd-")
    os.rmdir(rd)  # `kvproc up` makes it
    up = subprocess.Popen([sys.executable, "-m", "kvproc", "up", "--cluster", f"chaospd{os.getpid()}",
                           "--runtime-dir", rd, "--host-mib", "64"], stdout=subprocess.PIPE, text=True)
    try:
        line = up.stdout.readline() if up.stdout else ""
        if "up; manifest" not in line:
            raise RuntimeError(f"kvproc up did not start: {line!r}")
        (tier_pid,) = [p.pid for p in mf.read_manifest(rd).processes if p.role == "host_tier"]
        with ClusterStore.start(16 << 20, tier_runtime_dir=rd) as P, \
                ClusterStore.start(16 << 20, tier_runtime_dir=rd) as D:
            prefill = _attach(P, model_name, handoff_deadline_s=2.0)
            decode = _attach(D, model_name, handoff_deadline_s=2.0)
            router = PdRouter(prefill, decode)
            end = time.monotonic() + duration_s
            with _Staller(tier_pid, every_s, stop_s, seed) as staller:
                while time.monotonic() < end:
                    spec = WorkloadSpec(conversations=6, turns=4, first_input=45, new_per_turn=20,
                                        output_per_turn=6, concurrency=3, seed=seed * 1000 + out.rounds)
                    want = _one_engine(model_name, spec)
                    for r in drive(router, spec, prefill.model.vocab_size):
                        out.turns += 1
                        if r.failed is not None:
                            out.failed_turns += 1
                            out.failures.append(f"round {out.rounds} c{r.conversation}-t{r.turn}: {r.failed}")
                        elif r.output != want[(r.conversation, r.turn)]:
                            out.wrong_outputs += 1
                            out.failures.append(f"round {out.rounds} c{r.conversation}-t{r.turn}: wrong output")
                    out.rounds += 1
                    if progress:
                        print(f"  round {out.rounds}: {out.turns} turns, {staller.stalls} stalls, "
                              f"{out.failed_turns} failed, {out.wrong_outputs} wrong", flush=True)
            out.stalls = staller.stalls
            counters.update(router.counters)
            time.sleep(stop_s + 1.0)  # the tier runs again and the stores reconnect; what was kept back is sent
            assert D.store is not None
            deadline = time.monotonic() + 30
            while True:  # the tier settles what the stalls left (abandoned reservations, claims, releases)
                tier = D.store.stats()["tier"]
                if not (tier["open_leases"] or tier["open_saves"] or tier["open_handoffs"]) or \
                        time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            out.tier_after = {k: int(tier.get(k, 0)) for k in (
                "open_leases", "open_saves", "open_handoffs", "pending_pages", "leases_reclaimed_by_ttl",
                "saves_reclaimed_by_ttl", "handoffs_reclaimed_by_ttl", "leases_released_abandoned",
                "queries_refused_abandoned", "saves_aborted_abandoned")}
    finally:
        subprocess.run([sys.executable, "-m", "kvproc", "down", "--runtime-dir", rd, "--timeout", "10"],
                       check=False, capture_output=True)
        up.wait(15)
    out.handoffs_completed = counters["handoffs_completed"]
    out.handoffs_recomputed = counters["handoffs_recomputed"]
    return out


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvproc bench chaos-pd", description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (default 60)")
    p.add_argument("--model", default="dense", choices=["dense", "mla", "hybrid", "swa"])
    p.add_argument("--fault-every", type=float, default=6.0, help="seconds between stalls (jittered +-50%%)")
    p.add_argument("--stop-max", type=float, default=4.5, help="longest SIGSTOP of the tier (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.add_argument("--no-progress", action="store_true")
    a = p.parse_args(argv)
    s = run(a.duration, a.model, a.fault_every, a.stop_max, a.seed, progress=not a.no_progress)
    print(f"chaos-pd ({a.model}): {s.rounds} rounds, {s.turns} turns, {s.stalls} tier stalls; failed turns "
          f"{s.failed_turns}, wrong outputs {s.wrong_outputs}; hand-offs {s.handoffs_completed}, recomputed by the "
          f"decode side {s.handoffs_recomputed}")
    print("tier after the stalls: " + ", ".join(f"{k} {v}" for k, v in s.tier_after.items()))
    for f in s.failures[:20]:
        print("  " + f)
    if a.json:
        with open(a.json, "w") as out:
            json.dump({**s.__dict__, "ok": s.ok}, out, indent=2)
    return 0 if s.ok else 1
