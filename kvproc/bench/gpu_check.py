"""`kvproc bench gpu`: the GPU data path's check, one script, under 5 minutes (issue 19).

Parts, each printed with what ran and what was skipped:
1. round trip: every model shape (`MODEL_NAMES`) saved to a host tier, its arenas cleared, loaded into other ids,
   compared byte for byte; through each mover this machine has (`memmove`, `torch` and `cma` on any Linux; `cuda`
   on a GPU, the same executor code as `torch` with the arenas on the GPU).
2. bandwidth: saves and loads of 64 KiB / 1 MiB / 16 MiB blocks, contiguous and scattered, as a ratio to torch's
   `copy_` of the same bytes in the same run (on a GPU: `copy_(non_blocking=True)` between the device and pinned
   host memory, which is also the D2H / H2D limit that run measures; on CPU: a CPU `copy_`).
3. the demo at a small scale on the GPU (`kvproc demo --device cuda`: no_cache / device_only / kvproc, with the
   copy workers and host tier as processes), its outputs identical across the three runs. SKIPPED without CUDA.

NEEDS-GPU-CHECK: every CUDA branch below (`round_trip(..., "cuda:0")`, `_cuda_bandwidth`) has never run: no GPU where
it was written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from kvproc.bench.copybench import best_time
from kvproc.contract import GroupKind, GroupSpec, KvArena, KvSpec, validate_layout
from kvproc.engine.models import MODEL_NAMES, build_model
from kvproc.ipc.orders import BoundedCopy, LoadOrder, SaveOrder
from kvproc.store.build import model_repack
from kvproc.tiers.layout import HostLayout
from kvproc.workers.copy_exec import CopyError, CopyExecutor
from kvproc.workers.movers import mover_for

SIZES = {"64KiB": 64 << 10, "1MiB": 1 << 20, "16MiB": 16 << 20}
DEMO_SKIP = "demo on a GPU (kvproc demo --device cuda): no CUDA device"
DEMO_ARGS = ["--device", "cuda", "--scale", "0.05", "--conversations", "4", "--turns", "2", "--concurrency", "2",
             "--no-progress"]


def _best(fn: Callable[[], object], repeats: int) -> float:
    return best_time(fn, repeats, warm=True)


# ---- 1. round trip ------------------------------------------------------------------------------------------------

def round_trip(model_name: str, blocks: int, device: str = "cpu") -> list[dict[str, Any]]:
    """Save every paged block and one slot of each bounded group, clear the arenas, load them into other ids; the same
    bytes, through the executor over each mover `device` has (on CPU: memmove, and torch, the GPU path's executor and
    batch logic on CPU tensors; on a GPU: cuda, the arenas copied there), and on CPU through the cma mover too (this
    process as the engine)."""
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
    for mover in ([mover_for("cpu"), mover_for("cpu", kind="torch")] if device == "cpu" else [mover_for(device)]):
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


# ---- 2. bandwidth -------------------------------------------------------------------------------------------------

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


def _cuda_bandwidth(block_bytes: int, batch_bytes: int, repeats: int) -> list[dict[str, Any]]:
    """NEEDS-GPU-CHECK: the cuda mover's saves (D2H) and loads (H2D) against pinned `copy_(non_blocking=True)`."""
    mv = mover_for("cuda:0")
    n = max(2, batch_bytes // block_bytes)
    dev = torch.randint(0, 256, (2 * n * block_bytes,), dtype=torch.uint8, device="cuda:0")
    host = torch.zeros(2 * n * block_bytes, dtype=torch.uint8).pin_memory()

    def sync(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            fn()
            torch.cuda.synchronize()
        return run

    d2h = _best(sync(lambda: host[: n * block_bytes].copy_(dev[: n * block_bytes], non_blocking=True)), repeats)
    h2d = _best(sync(lambda: dev[: n * block_bytes].copy_(host[: n * block_bytes], non_blocking=True)), repeats)
    rng = np.random.default_rng(2)
    out = []
    for shape in ("contiguous", "scattered"):
        ids = list(range(n)) if shape == "contiguous" else rng.permutation(2 * n)[:n].tolist()
        slots = list(range(n)) if shape == "contiguous" else rng.permutation(2 * n)[:n].tolist()
        for op, base in (("save", d2h), ("load", h2d)):
            fn = (lambda i=ids, h=slots: mv.rows(host, block_bytes, h, dev, block_bytes, i, block_bytes, 0)) \
                if op == "save" else (lambda i=ids, h=slots: mv.rows(dev, block_bytes, i, host, block_bytes, h,
                                                                     block_bytes, 0))
            s = _best(fn, repeats)
            out.append({"op": op, "block_bytes": block_bytes, "layout": shape, "mover": "cuda",
                        "gbps": n * block_bytes / s / 1e9, "baseline": "pinned copy_(non_blocking=True)",
                        "baseline_gbps": n * block_bytes / base / 1e9, "ratio": base / s})
    return out


# ---- 3. the demo -------------------------------------------------------------------------------------------------

def demo(model_name: str) -> dict[str, Any]:
    """NEEDS-GPU-CHECK: `kvproc demo --device cuda` at a small scale, as its own command (the CLI a user runs); ok
    when every run completed every turn and the outputs are identical across them."""
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "demo.json")
        rc = subprocess.run([sys.executable, "-m", "kvproc", "demo", "--model", model_name, *DEMO_ARGS, "--json", path],
                            check=False).returncode
        data: dict[str, Any] = {}
        if rc == 0:
            with open(path) as f:
                data = json.load(f)
    runs = data.get("runs", {})
    ok = rc == 0 and bool(data.get("outputs_identical")) and all(r["turns_failed"] == 0 for r in runs.values())
    return {"model": model_name, "rc": rc, "outputs_identical": data.get("outputs_identical"), "ok": ok}


# ---- main ---------------------------------------------------------------------------------------------------------

def run(quick: bool) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    blocks, batch, repeats = (4, 1 << 20, 1) if quick else (32, 64 << 20, 3)
    sizes = {"64KiB": 64 << 10} if quick else SIZES
    result: dict[str, Any] = {"cuda": cuda, "gpu": torch.cuda.get_device_name(0) if cuda else None,
                              "round_trip": [], "bandwidth": [], "demo": [], "skipped": []}
    for name in MODEL_NAMES:
        result["round_trip"] += round_trip(name, blocks)
        if cuda:
            result["round_trip"] += round_trip(name, blocks, "cuda:0")
    for bb in sizes.values():
        result["bandwidth"] += bandwidth(bb, max(batch, 2 * bb), repeats)
        if cuda:
            result["bandwidth"] += _cuda_bandwidth(bb, max(batch, 2 * bb), repeats)
    if not cuda:
        result["skipped"] += ["round trip through the cuda mover: no CUDA device",
                              "bandwidth of the cuda mover against pinned copy_(non_blocking=True): no CUDA device"]
    if cuda:
        result["demo"] = [demo(name) for name in (MODEL_NAMES[:1] if quick else MODEL_NAMES)]
    else:
        result["skipped"].append(DEMO_SKIP)
    return result


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kvproc bench gpu", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny sizes (the smoke test)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    t0 = time.perf_counter()
    r = run(args.quick)
    print(f"kvproc bench gpu: cuda={'yes, ' + str(r['gpu']) if r['cuda'] else 'no'}")
    print("round trip (save, clear, load elsewhere; bit-exact):")
    for x in r["round_trip"]:
        print(f"  {x['model']:<7} {x['mover']:<8} {x['blocks']:>3} blocks  {'ok' if x['ok'] else 'MISMATCH'}"
              + (f"  ({x['error']})" if x.get("error") else ""))
    print("bandwidth (best of repeats; ratio = baseline time / mover time):")
    for x in r["bandwidth"]:
        print(f"  {x['op']:<4} {x['block_bytes'] >> 10:>6} KiB {x['layout']:<10} {x['mover']:<8} "
              f"{x['gbps']:7.2f} GB/s  vs {x['baseline']} {x['baseline_gbps']:7.2f} GB/s  {x['ratio']:.2f}x"
              + (f"  (memcpy {x['memcpy_gbps']:.2f} GB/s, {x['ratio_vs_memcpy']:.2f}x)" if "memcpy_gbps" in x else ""))
    for x in r["demo"]:
        print(f"demo --device cuda: {x['model']:<7} rc={x['rc']} outputs identical: {x['outputs_identical']}")
    for s in r["skipped"]:
        print(f"SKIPPED: {s}")
    print(f"({time.perf_counter() - t0:.1f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0 if all(x["ok"] for x in r["round_trip"] + r["demo"]) else 1
