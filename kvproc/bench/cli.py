"""`kvproc bench NAME`: one dispatcher; each benchmark is its own module with `main(argv) -> int`."""

from __future__ import annotations

import importlib
import sys

BENCHES: dict[str, tuple[str, str]] = {
    "replay": ("kvproc.bench.replay", "replay a Mooncake trace: hit ratios and index throughput"),
    "hash": ("kvproc.bench.hashbench", "hashing and probing against one hash call over the same bytes"),
    "copy": ("kvproc.bench.copybench", "copy-worker throughput against numpy.copyto"),
    "ipc": ("kvproc.bench.ipcbench", "resolve/seal round trips against a raw pyzmq round trip"),
    "remote": ("kvproc.bench.remotebench", "Mooncake tier write-behind/pull against raw batch put/get (kvproc[remote])"),
    "pooled": ("kvproc.bench.pooled", "the Mooncake trace over N nodes: local host tiers vs a shared remote tier"),
    "gpu": ("kvproc.bench.gpu_check", "the GPU data path check: round trips, mover bandwidth vs copy_ (CPU parts without CUDA)"),
    "chaos": ("kvproc.bench.chaos", "engines on a shared tier under cancellations and faults; every byte checked"),
    "chaos-pd": ("kvproc.bench.chaos_pd", "P/D on a shared tier SIGSTOPped again and again; every turn checked"),
    # needs vLLM installed (`make venv-vllm`; run with .venv-vllm/bin/python)
    "vllm": ("kvproc.integrations.vllm.bench", "vLLM alone vs vLLM + kvproc vs vLLM + its disk connector"),
    # needs SGLang installed (`make venv-sglang`; run with .venv-sglang/bin/python)
    "sglang": ("kvproc.integrations.sglang.bench", "SGLang HiCache storage: kvproc vs its file and Mooncake backends"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: kvproc bench NAME [ARGS...]\n\nbenchmarks:")
        for name, (_, help_) in BENCHES.items():
            print(f"  {name:<8} {help_}")
        return 0
    name = argv[0]
    if name not in BENCHES:
        print(f"kvproc bench: unknown benchmark {name!r}; one of {', '.join(BENCHES)}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHES[name][0])
    return int(module.main(argv[1:]) or 0)
