"""`kvproc demo --pd`: the demo's workload through prefill/decode disaggregation over kvproc.

Topology: one host tier started with `kvproc up` (its own process, shared), a prefill engine and a decode engine
(each a separate scheduler process with its own copy worker, `kvproc.engine.pd.EngineProcess`), and a router in this
process (`PdRouter`) that sends each turn to prefill, then the envelope to decode. Two runs: the envelope emitted at
once (decode waits for the Handoff saves in full-hit mode) and with the "KV ready" barrier (emitted only after the
saves are visible), beside a single-engine kvproc run of the same workload for `pd_outputs_identical`.
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import time
from collections import Counter
from typing import Any, Callable, TextIO

from kvproc.engine.metrics import RunSummary, summarize
from kvproc.engine.pd import EngineProcess, EngineSpec, PdRouter
from kvproc.engine.topology import PoolSizes
from kvproc.engine.workload import TurnRecord, WorkloadSpec, drive

_runs = itertools.count()


class SharedTier:
    """`kvproc up` as a child process, stopped with `kvproc down` (the standalone tier engines share)."""

    def __init__(self, host_bytes: int, log: TextIO | None) -> None:
        self.name = f"pd{os.getpid()}x{next(_runs)}"
        self.runtime_dir = f"/tmp/kvproc-{self.name}"
        mib = max(1, -(-host_bytes // (1 << 20)))
        self.proc = subprocess.Popen([sys.executable, "-m", "kvproc", "up", "--cluster", self.name, "--runtime-dir",
                                      self.runtime_dir, "--host-mib", str(mib)], stdout=subprocess.PIPE, text=True,
                                     stderr=log)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if "up; manifest" not in line:
            self.close()
            raise RuntimeError(f"kvproc up did not come up: {line!r}")

    def close(self) -> None:
        subprocess.run([sys.executable, "-m", "kvproc", "down", "--runtime-dir", self.runtime_dir, "--timeout", "15"],
                       check=False, capture_output=True)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


def run_pd(args: argparse.Namespace, spec: WorkloadSpec, sizes: PoolSizes, vocab_size: int, barrier: bool,
           make_progress: Callable[[], Any], log: TextIO | None) -> tuple[RunSummary, list[TurnRecord], dict[str, Any]]:
    tier = SharedTier(2 * sizes.host_bytes, log)
    engines: list[EngineProcess] = []
    try:
        for role in ("prefill", "decode"):
            engines.append(EngineProcess(EngineSpec(
                role, args.model, sizes.device_blocks, sizes.live_slots, sizes.staging_slots, sizes.host_bytes,
                tier.runtime_dir, sizes.page_tokens, args.seed, args.chunk_tokens, args.checkpoint_every_pages,
                handoff_barrier=barrier)))
        router = PdRouter(engines[0], engines[1])
        progress = make_progress()  # after the engines are up: the bar times the workload, not the start-up
        t0 = time.perf_counter()
        records = drive(router, spec, vocab_size, on_turn=progress.tick)
        wall = time.perf_counter() - t0
        progress.close()
    finally:
        for e in engines:
            e.close()
        tier.close()
    counters: Counter[str] = Counter(router.counters)
    stats = {"router": dict(counters), "prefill": engines[0].stats if engines else {},
             "decode": engines[1].stats if len(engines) > 1 else {}}
    return summarize(records, wall), records, stats
