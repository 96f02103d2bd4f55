"""`kvproc bench gpu`: the GPU data path's check, one script, under 5 minutes (issue 19).

Groups of parts, each part isolated (`kvproc/bench/gpu_runner.py`: a failure is recorded with its traceback and the
next part runs; on a GPU each CUDA group runs in a child process of its own; the JSON is rewritten after each part):
0. sanity (CUDA): the device, a tiny pinned round trip, cudaHostRegister / Unregister of a numpy buffer, a segment
   pinned and unpinned, the device pointer of registered memory (cupy, where it imports), unregistered memory refused
   a mapping, and the GPU writing and reading mapped host memory (`kvproc/bench/gpu_cuda.py`).
1. cpu: every model shape (`MODEL_NAMES`) saved to a host tier, its arenas cleared, loaded into other ids, compared
   byte for byte, through `memmove`, `torch` and `cma`; and the executor's save / load bandwidth (memmove) of
   64 KiB / 1 MiB / 16 MiB blocks, contiguous and scattered, against torch's CPU `copy_` and memcpy of the same bytes.
2. round trips through the `cuda` (staged) and `cuda_mapped` movers (CUDA), one group each: the same `round_trip`
   code with the arenas copied to the GPU and a pinned host arena.
3. bandwidth of `cuda` and `cuda_mapped` (CUDA), one group each: saves and loads of 64 KiB / 1 MiB / 16 MiB blocks,
   contiguous and scattered, each part with its own pinned `copy_(non_blocking=True)` baseline of the same bytes
   (the D2H / H2D limit that run measures).
4. the demo at a small scale on the GPU (`kvproc demo --device cuda`: no_cache / device_only / kvproc, with the
   copy workers and host tier as processes), its outputs identical across the three runs; one part per model.
Without CUDA the CUDA groups print SKIPPED. The exit status is 0 only if every part passed.

NEEDS-GPU-CHECK: every CUDA branch (`round_trip(..., "cuda:0")`, `kvproc/bench/gpu_cuda.py`, `demo`) has never run:
no GPU where it was written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import numpy as np
import torch

from kvproc.bench.copybench import best_time
from kvproc.bench.gpu_runner import Group, Part, Recorder, all_passed, new_result
from kvproc.contract import GroupKind, GroupSpec, KvArena, KvSpec, validate_layout
from kvproc.engine.models import MODEL_NAMES, build_model
from kvproc.ipc.orders import BoundedCopy, LoadOrder, SaveOrder
from kvproc.native import describe as native_status
from kvproc.store.build import model_repack
from kvproc.tiers.layout import HostLayout
from kvproc.workers.copy_exec import CopyError, CopyExecutor
from kvproc.workers.movers import mover_for

SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}
DEMO_SKIP = "demo on a GPU (kvproc demo --device cuda): no CUDA device"
DEMO_TIMEOUT_S = 90.0  # one model's demo (each run starts its store's processes, each of which initialises CUDA)
BUDGET_S = 270.0  # the whole check; each CUDA group's child gets at most what is left
CUDA_KINDS = ("cuda", "cuda_mapped")  # the two CUDA movers, compared in the same run
DEMO_ARGS = ["--device", "cuda", "--scale", "0.05", "--conversations", "4", "--turns", "2", "--concurrency", "2",
             "--no-progress"]


def _best(fn: Callable[[], object], repeats: int) -> float:
    return best_time(fn, repeats, warm=True)


# ---- 1, 2. round trips ------------------------------------------------------------------------------------------------

def round_trip(model_name: str, blocks: int, device: str = "cpu", kind: str = "") -> list[dict[str, Any]]:
    """Save every paged block and one slot of each bounded group, clear the arenas, load them into other ids; the same
    bytes, through the executor over each mover `device` has (on CPU: memmove, and torch, the GPU path's executor and
    batch logic on CPU tensors; on a GPU: the mover `kind` names, the arenas copied there), and on CPU through the
    cma mover too (this process as the engine)."""
    model = build_model(model_name, num_blocks=2 * blocks, num_slots=4)
    layout = validate_layout(model.spec(), model.arenas(0))
    if device != "cpu":  # the model's arenas as tensors on the GPU (NEEDS-GPU-CHECK)
        layout = validate_layout(model.spec(), [(g, dataclasses.replace(a, tensor=a.tensor.to(device)))
                                                for g, a in layout.arenas])
    rng = np.random.default_rng(0)
    need = sum(a.num_blocks * (a.stored_bytes_per_block or a.bytes_per_block) for _, a in layout.arenas)
    hl = HostLayout.plan(layout, 4 * need + (1 << 20))
    paged = [(g, a) for g, a in layout.arenas if layout.spec.group(g).kind is GroupKind.PAGED]
    bounded = sorted({g for g, a in layout.arenas if layout.spec.group(g).kind is GroupKind.BOUNDED})

    def block(a: KvArena, i: int) -> np.ndarray:
        return a.byte_view()[i * a.block_stride : i * a.block_stride + a.bytes_per_block].cpu().numpy().copy()

    src, dst = list(range(blocks)), list(range(2 * blocks - 1, blocks - 1, -1))  # loaded reversed, elsewhere
    out = []
    before: dict[str, list[np.ndarray]] = {}
    for mover in ([mover_for("cpu"), mover_for("cpu", kind="torch")] if device == "cpu" else [mover_for(device, kind=kind)]):
        for _, a in layout.arenas:
            a.byte_view().copy_(torch.from_numpy(rng.integers(0, 256, a.byte_view().numel(), dtype=np.uint8)))
        # on a GPU the host tier's bytes are pinned, as a copy worker's segment would be
        host = torch.zeros(hl.total_bytes, dtype=torch.uint8, pin_memory=device != "cpu").numpy()
        ex = CopyExecutor(layout, host, hl, model_repack(model, layout), mover=mover)
        before = {a.name: [block(a, i) for i in src] for _, a in paged}
        slot0 = {a.name: block(a, 0) for g, a in layout.arenas if g in bounded}
        error = ""
        try:
            ex.save(SaveOrder("rt", src, list(range(blocks)), [BoundedCopy(g, 0, 0) for g in bounded]))
            for _, a in layout.arenas:
                a.byte_view().zero_()
            ex.load(LoadOrder("rt", list(range(blocks)), dst, [BoundedCopy(g, 1, 0) for g in bounded]))
        except CopyError as e:  # e.g. a repack hook that refuses what came back: a mismatch, reported as one
            error = str(e)
        ok = not error and all(np.array_equal(block(a, d), before[a.name][k]) for _, a in paged
                               for k, d in enumerate(dst)) and \
            all(np.array_equal(block(a, 1), slot0[a.name]) for g, a in layout.arenas if g in bounded)
        out.append({"model": model_name, "mover": ex.mover_name("load"), "blocks": blocks, "ok": bool(ok),
                    **({"error": error} if error else {})})
        ex.close()
    if device != "cpu":
        return out
    # cma: the "engine" is a private copy of the first paged arena in this process, moved in and back out by address
    _, a = paged[0]
    engine = np.zeros(a.byte_view().numel(), dtype=np.uint8)
    ex = CopyExecutor(layout)
    n = ex.engine_move(os.getpid(), True, [a.name], [engine.ctypes.data], a.block_stride, a.bytes_per_block, src,
                       dst)
    a.byte_view().zero_()
    n += ex.engine_move(os.getpid(), False, [a.name], [engine.ctypes.data], a.block_stride, a.bytes_per_block, src,
                        src)
    ok = n == 2 * blocks * a.bytes_per_block and all(np.array_equal(block(a, i), before[a.name][i]) for i in src)
    out.append({"model": model_name, "mover": ex.mover_name("engine"), "blocks": blocks, "ok": bool(ok)})
    ex.close()
    return out


# ---- 1. bandwidth on CPU -------------------------------------------------------------------------------------------------

def bandwidth(block_bytes: int, batch_bytes: int, repeats: int) -> list[dict[str, Any]]:
    """The executor's saves and loads (its mover: memmove) against torch's CPU `copy_` of the same bytes."""
    n = max(2, batch_bytes // block_bytes)
    dev = torch.zeros(2 * n * block_bytes, dtype=torch.uint8)
    dev.numpy()[:] = np.random.default_rng(1).integers(0, 256, dev.numel(), dtype=np.uint8)
    layout = validate_layout(KvSpec(16, (GroupSpec("kv", GroupKind.PAGED),)),
                             [("kv", KvArena("kv", dev, 2 * n, block_bytes, block_bytes))])
    hl = HostLayout.plan(layout, 2 * n * block_bytes + (1 << 16))
    host = np.ones(hl.total_bytes, dtype=np.uint8)  # pre-faulted
    ex = CopyExecutor(layout, host, hl)
    a, b = dev[: n * block_bytes], torch.from_numpy(host[: n * block_bytes])
    base_s = _best(lambda: b.copy_(a), repeats)
    # a second baseline, memcpy of the same bytes: torch's CPU copy_ splits 1 MiB over its intra-op threads, which on a
    # loaded 2-core machine costs ~20 ms a call (measured; ~60 us with torch.set_num_threads(1))
    memcpy_s = _best(lambda: np.copyto(host[: n * block_bytes], dev.numpy()[: n * block_bytes]), repeats)
    rng = np.random.default_rng(2)
    out = []
    for shape in ("contiguous", "scattered"):
        if shape == "contiguous":
            ids, slots = list(range(n)), list(range(n))
        else:
            ids, slots = rng.permutation(2 * n)[:n].tolist(), rng.permutation(min(hl.page_slots, 2 * n))[:n].tolist()
        for op in ("save", "load"):
            fn = (lambda i=ids, h=slots: ex.save(SaveOrder("bw", i, h))) if op == "save" else \
                (lambda i=ids, h=slots: ex.load(LoadOrder("bw", h, i)))
            s = _best(fn, repeats)
            out.append({"op": op, "block_bytes": block_bytes, "layout": shape, "mover": ex.mover_name(op),
                        "gbps": n * block_bytes / s / 1e9, "baseline": "torch cpu copy_",
                        "baseline_gbps": n * block_bytes / base_s / 1e9, "ratio": base_s / s,
                        "memcpy_gbps": n * block_bytes / memcpy_s / 1e9, "ratio_vs_memcpy": memcpy_s / s})
    ex.close()
    return out


# ---- 4. the demo -------------------------------------------------------------------------------------------------

def demo(model_name: str, timeout_s: float = 120.0, copy_mover: str = "auto") -> dict[str, Any]:
    """NEEDS-GPU-CHECK: `kvproc demo --device cuda` at a small scale, as its own command (the CLI a user runs); ok
    when every run completed every turn and the outputs are identical across them. Past `timeout_s` its whole
    process group (the store's processes too) is killed and the part fails."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "demo.json")
        proc = subprocess.Popen([sys.executable, "-m", "kvproc", "demo", "--model", model_name, *DEMO_ARGS,
                                 "--copy-mover", copy_mover, "--json", path], start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return {"model": model_name, "copy_mover": copy_mover, "rc": None, "outputs_identical": None,
                    "ok": False, "error": f"kvproc demo ran past {timeout_s:.0f} s"}
        data: dict[str, Any] = {}
        if rc == 0:
            with open(path) as f:
                data = json.load(f)
    runs = data.get("runs", {})
    ok = rc == 0 and bool(data.get("outputs_identical")) and all(r["turns_failed"] == 0 for r in runs.values())
    return {"model": model_name, "copy_mover": copy_mover, "rc": rc, "outputs_identical": data.get("outputs_identical"),
            "copy_movers": data.get("stats", {}).get("kvproc", {}).get("copy_movers"), "ok": ok,
            **({} if ok else {"error": f"kvproc demo: exit status {rc}, outputs identical: "
                                        f"{data.get('outputs_identical')}"})}


# ---- the plan ------------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Sizes:
    blocks: int  # per round trip
    batch: int  # bytes per bandwidth batch
    repeats: int
    sizes: dict[str, int]
    models: tuple[str, ...]  # the demo's

    @staticmethod
    def of(quick: bool) -> Sizes:
        if quick:
            return Sizes(4, 1 << 20, 1, {"64KiB": 64 << 10}, MODEL_NAMES[:1])
        return Sizes(32, 64 << 20, 5, SIZES, MODEL_NAMES)


def cpu_parts(z: Sizes) -> list[Part]:
    """Round trips through memmove, torch and cma (one part per model), then the CPU bandwidth (one per size)."""
    return [Part("round_trip", f"{name} cpu movers", partial(round_trip, name, z.blocks)) for name in MODEL_NAMES] + \
        [Part("bandwidth", f"{label} memmove", partial(bandwidth, bb, max(z.batch, 2 * bb), z.repeats))
         for label, bb in z.sizes.items()]


def cuda_round_trip_parts(z: Sizes, kind: str) -> list[Part]:
    return [Part("round_trip", f"{name} {kind}", partial(round_trip, name, z.blocks, "cuda:0", kind))
            for name in MODEL_NAMES]


def cuda_bandwidth_parts(z: Sizes, kind: str) -> list[Part]:
    from kvproc.bench.gpu_cuda import cuda_bandwidth

    return [Part("bandwidth", f"{label} {kind}", partial(cuda_bandwidth, kind, bb, max(z.batch, 2 * bb), z.repeats))
            for label, bb in z.sizes.items()]


def demo_parts(z: Sizes, deadline: float) -> list[Part]:
    """Each model's demo with the default (staged) cuda mover, then the first model's again with `cuda_mapped`."""
    def one(name: str, mover: str) -> list[dict[str, Any]]:
        left = deadline - time.monotonic()
        if left < 15:  # not started at all: a demo killed at once says nothing
            return [{"model": name, "copy_mover": mover, "rc": None, "outputs_identical": None, "ok": False,
                     "error": "not run: the check's time budget was spent"}]
        return [demo(name, min(DEMO_TIMEOUT_S, left), mover)]
    runs = [(name, "auto") for name in z.models] + [(z.models[0], "cuda_mapped")] if z.models else []
    return [Part("demo", f"{name} --device cuda --copy-mover {mover}", partial(one, name, mover))
            for name, mover in runs]


def groups(z: Sizes, deadline: float) -> list[Group]:
    """In the order they run: the cheapest checks first, the demo (the longest) last."""
    from kvproc.bench.gpu_cuda import sanity_parts

    out = [Group("sanity", sanity_parts, True, 60, "CUDA sanity (device, pinned copy, cudaHostRegister, mapped "
                                                    "access): no CUDA device"),
           Group("cpu", partial(cpu_parts, z), False, 0)]
    for kind in CUDA_KINDS:
        out.append(Group(f"round_trip_{kind}", partial(cuda_round_trip_parts, z, kind), True, 90,
                         f"round trip through the {kind} mover: no CUDA device"))
    for kind in CUDA_KINDS:
        out.append(Group(f"bandwidth_{kind}", partial(cuda_bandwidth_parts, z, kind), True, 90,
                         f"bandwidth of the {kind} mover against pinned copy_(non_blocking=True): no CUDA device"))
    out.append(Group("demo", partial(demo_parts, z, deadline), True, 0, DEMO_SKIP))
    return out


# ---- running it ----------------------------------------------------------------------------------------------------

def show(section: str, x: dict[str, Any]) -> str:
    """One row, as printed."""
    if section == "round_trip":
        return (f"{x['model']:<7} {x['mover']:<11} {x['blocks']:>3} blocks  {'ok' if x['ok'] else 'MISMATCH'}"
                + (f"  ({x['error']})" if x.get("error") else ""))
    if section == "bandwidth":
        head = f"{x['op']:<4} {x['block_bytes'] >> 10:>6} KiB {x['layout']:<10} {x['mover']:<11} "
        if "gbps" not in x:
            return head + f"FAILED: {x.get('error')}"
        return (head + f"{x['gbps']:7.2f} GB/s  vs {x['baseline']} {x['baseline_gbps']:7.2f} GB/s  {x['ratio']:.2f}x"
                + (f"  (memcpy {x['memcpy_gbps']:.2f} GB/s, {x['ratio_vs_memcpy']:.2f}x)" if "memcpy_gbps" in x
                   else "") + ("" if x.get("ok", True) else f"  FAILED: {x.get('error')}"))
    if section == "demo":
        return (f"demo --device cuda --copy-mover {x.get('copy_mover', 'auto')}: {x['model']:<7} rc={x['rc']} "
                f"outputs identical: {x['outputs_identical']} (copies by mover: {x.get('copy_movers')})")
    return json.dumps({k: v for k, v in x.items() if k != "traceback"}, default=str)


def gpu_name() -> str:
    """The device's name, or why it could not be read (a broken environment must not stop the run here)."""
    try:
        return str(torch.cuda.get_device_name(0))
    except Exception as e:  # noqa: BLE001 - the sanity group reports it properly
        return f"unreadable ({type(e).__name__}: {e})"


def run(quick: bool, json_path: str | None = None, only: list[str] | None = None, in_process: bool = False,
        budget_s: float = BUDGET_S) -> dict[str, Any]:
    """Every group (or those `only` names, in this process: how a child runs its group). On a GPU, unless
    `in_process`, each CUDA group but the demo runs in a child process within what is left of `budget_s`."""
    cuda = torch.cuda.is_available()
    deadline = time.monotonic() + budget_s
    result = new_result()
    result.update(cuda=cuda, gpu=gpu_name() if cuda else None,
                  env={"python": sys.version.split()[0], "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
                       "native": native_status()})
    rec = Recorder(result, json_path)
    z = Sizes.of(quick)
    for g in groups(z, deadline):
        if only is not None and g.name not in only:
            continue
        if g.cuda and not cuda:
            result["skipped"].append(g.skipped)
            continue
        left = deadline - time.monotonic()
        if only is None and left < 5:
            result["parts"].append({"group": g.name, "section": "", "name": g.name, "ok": False, "seconds": 0.0,
                                    "error": f"not run: the {budget_s:.0f} s budget was spent"})
            print(f"[FAILED] {g.name}: not run, the {budget_s:.0f} s budget was spent", flush=True)
            continue
        if g.cuda and g.cap_s and only is None and not in_process:
            rec.run_child(g, ["--quick"] if quick else [], min(g.cap_s, left))
        else:
            print(f"--- {g.name}", flush=True)
            rec.run_group(g, show)
    rec.save()
    return result


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvproc bench gpu", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test)")
    p.add_argument("--json", help="write the results here (rewritten after every part)")
    p.add_argument("--group", action="append", help="run only this group, in this process (how a child runs)")
    p.add_argument("--in-process", action="store_true", help="no child processes for the CUDA groups")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole check (default %(default)s)")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    if not args.group:
        print(f"kvproc bench gpu: cuda={'yes, ' + gpu_name() if torch.cuda.is_available() else 'no'}"
              f", torch {torch.__version__}, CUDA runtime {torch.version.cuda}, native: {native_status()}", flush=True)
    r = run(args.quick, args.json, args.group, args.in_process, args.budget)
    if args.group:
        return 0 if all(p["ok"] for p in r["parts"]) else 1
    for s in r["skipped"]:
        print(f"SKIPPED: {s}")
    failed = [p for p in r["parts"] if not p["ok"]]
    print(f"{len(r['parts']) - len(failed)} of {len(r['parts'])} parts passed"
          + "".join(f"\n  FAILED: {p['group']} / {p['name']}: {p.get('error')}" for p in failed))
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0 if all_passed(r) else 1
