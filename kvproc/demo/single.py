"""`kvproc demo`: one multi-turn chat workload through the reference engine, three ways, side by side.

Runs: `no_cache` (prefix caching off), `device_only` (prefix cache in the device pool only) and `kvproc` (device pool
plus the host tier). The device pool is sized as a multiple of the concurrent working set (`--device-factor`), which
cannot hold every conversation; the host tier is sized to hold them all. Prints a table (TTFT p50/p99, output tok/s,
turns completed/failed, prompt tokens served from the device pool, from the host tier, and computed), and optionally
writes JSON (`--json`) and a TTFT-per-turn plot (`--plot`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict
from typing import Any, TextIO

import structlog
import torch

from kvproc.engine.engine import Engine
from kvproc.engine.metrics import (
    RunSummary,
    first_difference,
    outputs_digest,
    outputs_identical,
    summarize,
    ttft_by_turn,
)
from kvproc.engine.models import MODEL_NAMES, SeqBatchItem, TinyModel
from kvproc.engine.models.base import DEVICES
from kvproc.engine.models.ranked import rank_models
from kvproc.engine.topology import (
    MODES,
    PoolSizes,
    Topology,
    make_store,
    per_page_bytes,
)
from kvproc.engine.workload import TurnRecord, WorkloadSpec, drive
from kvproc.store.types import StoreConfig
from kvproc.workers.movers import CUDA_MOVERS

PAGE_TOKENS = 16
DEFAULT_SCALE = 0.5  # `make demo` (three runs, store processes included) takes ~80 s on a 2-core machine


def _parser() -> argparse.ArgumentParser:
    d = WorkloadSpec()
    p = argparse.ArgumentParser(prog="kvproc demo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODEL_NAMES, default="dense")
    p.add_argument("--scale", type=float, default=DEFAULT_SCALE,
                   help=f"multiply every token count of the workload (default {DEFAULT_SCALE}; 1.0 = full size)")
    p.add_argument("--conversations", type=int, default=d.conversations)
    p.add_argument("--turns", type=int, default=d.turns)
    p.add_argument("--first-input", type=int, default=d.first_input, help="user tokens of the first turn")
    p.add_argument("--new-per-turn", type=int, default=d.new_per_turn, help="user tokens added by each later turn")
    p.add_argument("--output-per-turn", type=int, default=d.output_per_turn)
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="clients = max batch of the engine")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--chunk-tokens", type=int, default=512, help="token budget of one engine step")
    p.add_argument("--checkpoint-every-pages", type=int, default=8, help="bounded checkpoint / seal cadence")
    p.add_argument("--device-factor", type=float, default=1.0,
                   help="device pool = this x the peak concurrent working set (every client in its longest turn);"
                        " 1.0 holds a third of all conversations' KV")
    p.add_argument("--pin-fraction", type=float, default=StoreConfig().cacheable_pin_fraction,
                   help="StoreConfig.cacheable_pin_fraction: share of the pool cacheable saves may pin")
    p.add_argument("--runs", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    p.add_argument("--plot", metavar="PATH", help="write a PNG of TTFT per turn index")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--in-process", action="store_true",
                   help="host tier and copy path inside this process (default: their own processes, kvproc.store.cluster)")
    p.add_argument("--log", metavar="PATH", help="where the store processes' logs go (default: a temporary file)")
    p.add_argument("--ranks", type=int, default=1,
                   help="tensor-parallel ranks of the engine: lock-step ranks, a device pool, copy worker and host "
                        "tier each (outputs are those of --ranks 1)")
    p.add_argument("--metrics", metavar="HOST:PORT", default=None,
                   help="serve Prometheus /metrics of each run's cluster there (port 0: a free one; printed)")
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="where the models run: cpu, or cuda where a CUDA device is present (never run on a GPU yet:"
                        " docs/gpu.md)")
    p.add_argument("--copy-mover", choices=COPY_MOVERS, default="auto",
                   help="what the copy workers move bytes with: auto (memmove on cpu, the staged cuda mover on a "
                        "GPU), torch (the GPU path's batch logic on CPU tensors), cuda, or cuda_mapped (the GPU "
                        "reads and writes the pinned host rows itself; --device cuda); docs/gpu.md")
    p.add_argument("--pd", action="store_true",
                   help="prefill/decode disaggregation: a prefill and a decode engine (separate processes) sharing a"
                        " `kvproc up` host tier, beside a single-engine kvproc run of the same workload")
    return p


COPY_MOVERS = ("auto", "torch", *CUDA_MOVERS)  # `--copy-mover` ("auto": the device's default)


def pool_sizes(spec: WorkloadSpec, model_name: str, device_factor: float, every_pages: int) -> PoolSizes:
    """Device pool: `device_factor` x the concurrent working set. Host tier: every conversation, with room."""
    turn_pages = math.ceil(spec.max_turn_tokens / PAGE_TOKENS)
    device_blocks = max(turn_pages + 1, int(device_factor * spec.concurrency * turn_pages))
    staging = max(spec.concurrency, device_blocks // every_pages)
    probe = make_store("no_cache", model_name, PoolSizes(1, 1, 1, 0, PAGE_TOKENS))
    page_bytes, slot_bytes = per_page_bytes(rank_models(probe.model)[0])
    probe.close()
    all_pages = spec.conversations * turn_pages
    all_ckpts = spec.conversations * spec.turns * (turn_pages // every_pages + 2)
    bounded_fraction = 0.25  # build_local_store's default split of the host budget
    need = all_pages * page_bytes / (1 - bounded_fraction)
    if slot_bytes:
        need = max(need, all_ckpts * slot_bytes / bounded_fraction)
    return PoolSizes(device_blocks, spec.concurrency, staging, int(1.5 * need) + (16 << 20), PAGE_TOKENS)


class Progress:
    """A one-line progress bar on a stream (stderr): no dependency, redrawn at most 10 times a second."""

    def __init__(self, label: str, total: int, stream: TextIO | None, width: int = 30) -> None:
        self.label, self.total, self.stream, self.width = label, total, stream, width
        self.done = 0
        self.t0 = time.perf_counter()
        self._last = 0.0

    def tick(self, _rec: TurnRecord | None = None) -> None:
        self.done += 1
        now = time.perf_counter()
        if self.stream is not None and (now - self._last > 0.1 or self.done == self.total):
            self._last = now
            fill = self.width * self.done // max(1, self.total)
            self.stream.write(f"\r  {self.label:<12} [{'#' * fill}{'.' * (self.width - fill)}] "
                              f"{self.done}/{self.total} turns {now - self.t0:6.1f}s")
            self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self.stream.write("\n")
            self.stream.flush()


def _warm_up(topo: Topology, chunk_tokens: int, batch: int) -> None:
    """One prefill chunk and one decode batch before the clock starts (torch's first calls are slow). Writes only
    into free blocks and live slots that admission resets, before any request exists."""
    for m in rank_models(topo.model):
        _warm_up_one(m, chunk_tokens, batch)


def _warm_up_one(m: TinyModel, chunk_tokens: int, batch: int) -> None:
    slots = {g.name: 0 for g in m.spec().bounded_groups}
    n = min(chunk_tokens, (m.num_blocks - 1) * m.page_tokens)
    blocks = list(range(n // m.page_tokens + 1))
    m.forward([SeqBatchItem(list(range(2, 2 + n)), 0, blocks, slots)])
    k = min(batch, m.num_slots)
    m.forward([SeqBatchItem([2], n, blocks, {g: i for g in slots}) for i in range(k)])
    for g in slots:
        for i in range(k):
            m.reset_slot(g, i)


def workload(args: argparse.Namespace) -> tuple[WorkloadSpec, PoolSizes]:
    """The workload the flags ask for, and the pools sized for it."""
    spec = WorkloadSpec(args.conversations, args.turns, args.first_input, args.new_per_turn, args.output_per_turn,
                        args.concurrency, args.seed).scaled(args.scale)
    return spec, pool_sizes(spec, args.model, args.device_factor, args.checkpoint_every_pages)


def run_one(mode: str, args: argparse.Namespace, spec: WorkloadSpec, sizes: PoolSizes, stream: TextIO | None,
            after: Callable[[Topology], None] | None = None) -> tuple[RunSummary, list[TurnRecord], dict[str, Any]]:
    """One run; `after(topo)` is called once the workload is done, before the store closes (a caller that reads
    the run's cluster, e.g. its /metrics)."""
    config = StoreConfig(cacheable_pin_fraction=args.pin_fraction)
    metrics = getattr(args, "metrics", None)
    with make_store(mode, args.model, sizes, seed=args.seed, config=config,
                    processes=not args.in_process, ranks=args.ranks, metrics=metrics,
                    device=getattr(args, "device", "cpu"),
                    copy_mover="" if getattr(args, "copy_mover", "auto") == "auto" else args.copy_mover) as topo:
        if topo.metrics_address and stream is not None:
            stream.write(f"  {mode}: metrics http://{topo.metrics_address}/metrics\n")
        _warm_up(topo, args.chunk_tokens, spec.concurrency)
        engine = Engine(topo.model, topo.store, ranks=args.ranks, max_batch=spec.concurrency,
                        chunk_tokens=args.chunk_tokens,
                        checkpoint_every_pages=args.checkpoint_every_pages, prefix_cache=topo.prefix_cache)
        bar = Progress(mode, spec.total_turns, stream)
        t0 = time.perf_counter()
        records = drive(engine, spec, topo.model.vocab_size, on_turn=bar.tick)
        wall = time.perf_counter() - t0
        bar.close()
        if after is not None:
            after(topo)
        stats = {"engine": engine.stats(), "store": topo.store.stats()}
        if topo.copy_movers is not None:  # which mover moved the copies (`--copy-mover`)
            stats["copy_movers"] = topo.copy_movers()
    return summarize(records, wall), records, stats


def format_table(summaries: dict[str, RunSummary]) -> str:
    head = (f"{'run':<12} {'TTFT p50':>9} {'TTFT p99':>9} {'out tok/s':>10} {'turns ok/fail':>14} "
            f"{'prompt tok':>11} {'from device':>12} {'from host':>10} {'computed':>9}")
    lines = [head, "-" * len(head)]
    for name, s in summaries.items():
        lines.append(f"{name:<12} {s.ttft_p50_ms:>7.0f}ms {s.ttft_p99_ms:>7.0f}ms {s.output_tok_s:>10.1f} "
                     f"{f'{s.turns_completed}/{s.turns_failed}':>14} {s.prompt_tokens:>11,} "
                     f"{s.device_hit_tokens:>12,} {s.host_hit_tokens:>10,} {s.computed_tokens:>9,}")
    return "\n".join(lines)


def _plot(path: str, by_turn: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, ys in by_turn.items():
        ax.plot(range(1, len(ys) + 1), ys, marker="o", label=name)
    ax.set_xlabel("turn index")
    ax.set_ylabel("TTFT, median (ms)")
    ax.set_title("TTFT per turn: no cache vs device-only prefix cache vs kvproc (host tier)")
    ax.set_xticks(range(1, max(len(v) for v in by_turn.values()) + 1))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@contextlib.contextmanager
def _quiet_store_logs(path: str) -> Iterator[TextIO]:
    """Send the store processes' info logs to `path` instead of the terminal; yields the real stderr.

    KVPROC-GAP: `ClusterStore.start` has no log-level option (children always log at info, to the inherited fd 2),
    so the demo points fd 2 at a file while the clusters run and writes its progress bar to a duplicate of the
    real stderr. Our own process's structlog output (launcher events) is filtered to warnings meanwhile."""
    sys.stderr.flush()
    saved_fd = os.dup(2)
    real = os.fdopen(os.dup(saved_fd), "w")
    saved_config = structlog.get_config()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    with open(path, "a") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield real
        finally:
            sys.stderr.flush()
            os.dup2(saved_fd, 2)
            os.close(saved_fd)
            real.close()
            structlog.configure(**saved_config)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.ranks < 1 or (args.pd and args.ranks != 1):
        print(f"kvproc demo: --ranks must be >= 1 (and 1 with --pd: the P/D demo runs one rank), got {args.ranks}",
              file=sys.stderr)
        return 2
    if args.device != "cpu" and not torch.cuda.is_available():
        print(f"kvproc demo: --device {args.device} needs a CUDA device, and torch.cuda.is_available() is False here"
              " (run with the default --device cpu)", file=sys.stderr)
        return 2
    if args.copy_mover != "auto" and (args.in_process or args.pd):
        print(f"kvproc demo: --copy-mover {args.copy_mover} picks the copy workers' mover: it needs them (not "
              "--in-process) and one engine (not --pd)", file=sys.stderr)
        return 2
    if args.copy_mover in CUDA_MOVERS and args.device == "cpu":
        print(f"kvproc demo: --copy-mover {args.copy_mover} moves GPU arenas: it needs --device cuda",
              file=sys.stderr)
        return 2
    if args.device != "cpu" and (args.pd or args.ranks != 1):
        print(f"kvproc demo: --device {args.device} runs one rank without --pd (the P/D and multi-rank demos run on"
              " cpu)", file=sys.stderr)
        return 2
    if args.pd:
        return _main_pd(args)
    modes = [m.strip() for m in args.runs.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        print(f"kvproc demo: --runs must name some of {MODES}, got {args.runs!r}", file=sys.stderr)
        return 2
    torch.manual_seed(args.seed)
    spec, sizes = workload(args)
    turn_pages = math.ceil(spec.max_turn_tokens / PAGE_TOKENS)
    share = sizes.device_blocks / (spec.conversations * turn_pages)
    ranks = f" x {args.ranks} ranks" if args.ranks > 1 else ""
    print(f"kvproc demo: model {args.model}{ranks}, {spec.conversations} conversations x {spec.turns} turns, first turn "
          f"{spec.first_input} tokens, +{spec.new_per_turn}/turn, {spec.output_per_turn} out/turn, concurrency "
          f"{spec.concurrency} (scale {args.scale:g})")
    print(f"  device pool {sizes.device_blocks} blocks of {PAGE_TOKENS} tokens ({args.device_factor:g}x the "
          f"concurrent working set, {share:.0%} of all conversations), host tier {sizes.host_bytes >> 20} MiB")
    summaries: dict[str, RunSummary] = {}
    records: dict[str, list[TurnRecord]] = {}
    stats: dict[str, dict[str, Any]] = {}
    log_path = args.log or os.path.join(tempfile.gettempdir(), f"kvproc-demo-{os.getpid()}.log")
    with _quiet_store_logs(log_path) as stderr:
        stream = None if args.no_progress else stderr
        for mode in modes:
            summaries[mode], records[mode], stats[mode] = run_one(mode, args, spec, sizes, stream)
    identical = outputs_identical(list(records.values()))
    print()
    print(format_table(summaries))
    print(f"\noutputs identical across runs: {identical}")
    diff = None if identical else first_difference(records)
    if diff:
        print(f"  first difference: {diff}")
    by_turn = {m: ttft_by_turn(records[m], spec.turns) for m in modes}
    if args.json:
        out = {"runs": {m: s.as_dict() for m, s in summaries.items()}, "outputs_identical": identical,
               "first_difference": diff, "model": args.model, "workload": asdict(spec), "scale": args.scale,
               "sizes": asdict(sizes), "ttft_p50_ms_by_turn": by_turn, "ranks": args.ranks,
               "device": args.device, "copy_mover": args.copy_mover,
               "outputs_digest": {m: outputs_digest(records[m]) for m in modes},
               "stats": json.loads(json.dumps(stats, default=str))}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    if args.plot:
        _plot(args.plot, by_turn)
    if not args.in_process:
        print(f"store process logs: {log_path}")
    return 0


def _main_pd(args: argparse.Namespace) -> int:
    """`--pd`: single-engine kvproc, then P/D without and with the KV-ready barrier; outputs compared turn by turn."""
    from kvproc.demo.pd import run_pd
    from kvproc.engine.models import build_model

    torch.manual_seed(args.seed)
    spec = WorkloadSpec(args.conversations, args.turns, args.first_input, args.new_per_turn, args.output_per_turn,
                        args.concurrency, args.seed).scaled(args.scale)
    sizes = pool_sizes(spec, args.model, args.device_factor, args.checkpoint_every_pages)
    vocab = build_model(args.model, num_blocks=2, num_slots=2, page_tokens=PAGE_TOKENS).vocab_size
    print(f"kvproc demo --pd: model {args.model}, {spec.conversations} conversations x {spec.turns} turns, first "
          f"turn {spec.first_input} tokens, +{spec.new_per_turn}/turn, {spec.output_per_turn} out/turn, concurrency "
          f"{spec.concurrency} (scale {args.scale:g}); prefill and decode engines share one `kvproc up` host tier")
    summaries: dict[str, RunSummary] = {}
    records: dict[str, list[TurnRecord]] = {}
    stats: dict[str, dict[str, Any]] = {}
    log_path = args.log or os.path.join(tempfile.gettempdir(), f"kvproc-demo-{os.getpid()}.log")
    with _quiet_store_logs(log_path) as stderr, open(log_path, "a") as log:
        stream = None if args.no_progress else stderr
        summaries["kvproc"], records["kvproc"], stats["kvproc"] = run_one("kvproc", args, spec, sizes, stream)
        for name, barrier in (("pd", False), ("pd_barrier", True)):
            def bar(name: str = name) -> Progress:
                return Progress(name, spec.total_turns, stream)

            summaries[name], records[name], stats[name] = run_pd(args, spec, sizes, vocab, barrier, bar, log)
    identical = outputs_identical([records["kvproc"], records["pd"], records["pd_barrier"]])
    pd_counts = {n: stats[n]["router"] for n in ("pd", "pd_barrier")}
    print()
    print(format_table(summaries))
    for n, c in pd_counts.items():
        print(f"{n:<12} hand-offs completed {c.get('handoffs_completed', 0)}, rejected "
              f"{c.get('handoffs_rejected', 0)}, retried {c.get('handoffs_retried', 0)}, computed by decode "
              f"{c.get('handoffs_recomputed', 0)}")
    print(f"\nP/D outputs identical to the single-engine run: {identical}")
    diff = None if identical else first_difference(records)
    if diff:
        print(f"  first difference: {diff}")
    if args.json:
        out = {"runs": {m: s.as_dict() for m, s in summaries.items()},
               "handoffs_completed": pd_counts["pd"].get("handoffs_completed", 0),
               "handoffs_rejected": pd_counts["pd"].get("handoffs_rejected", 0),
               "handoffs_retried": pd_counts["pd"].get("handoffs_retried", 0),
               "handoffs_recomputed": pd_counts["pd"].get("handoffs_recomputed", 0),
               "barrier": {k: pd_counts["pd_barrier"].get(k, 0) for k in
                           ("handoffs_completed", "handoffs_rejected", "handoffs_retried",
                            "handoffs_recomputed")},
               "pd_outputs_identical": identical, "first_difference": diff, "model": args.model,
               "workload": asdict(spec), "scale": args.scale, "sizes": asdict(sizes),
               "stats": json.loads(json.dumps(stats, default=str))}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    print(f"store and engine process logs: {log_path}")
    return 0 if identical and all(s.turns_failed == 0 for s in summaries.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
