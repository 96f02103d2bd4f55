"""IPC round trip: kvproc's RPC layer against a raw pyzmq DEALER/ROUTER echo of the same payload size.

    .venv/bin/python bench/ipc_rtt.py [--n 3000] [--rounds 5] [--sizes 64,4096]

Both servers run in their own process on an ipc:// socket in the same run; rounds alternate raw / kvproc so that
drift on a shared machine hits both alike. Measured per size:
- raw:         DEALER send + recv against a ROUTER echo loop (one frame, no decoding): the floor;
- kvproc ping: `RpcClient.request(Ping(data))` -- client I/O thread, msgspec, deadline, future; the server answers
               Ping on its socket thread (the transport's own probe). (Until the blocking resolver's removal,
               `request()` ran on a socket of the calling thread's own: 1.23x raw against 2.5x now; bench/RESULTS.md);
- kvproc echo: `RpcClient.request(Echo(data))` -- the same, plus the server's hop to a handler thread and back
               (what every role request pays);
- kvproc future: `RpcClient.call(Ping(data)).result()` -- the Future path, what `request()` is now.
Reported: median and p99 in microseconds, and each kvproc median over the raw median. (The store's own calls await
the future path on its event loop: `kvproc bench ipc` measures those in whole resolves.)
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable

import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kvproc.bench.ipcbench import RAW_ECHO  # noqa: E402  (the raw DEALER/ROUTER echo, one definition)
from kvproc.ipc import messages as m  # noqa: E402
from kvproc.ipc.client import RpcClient  # noqa: E402
from kvproc.runtime import RoleConfig, launch  # noqa: E402


def timed(fn: Callable[[], object], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter_ns()
        fn()
        out.append((time.perf_counter_ns() - t0) / 1000)
    return out


def p99(xs: list[float]) -> float:
    return sorted(xs)[int(len(xs) * 0.99) - 1]


def _cases(raw: zmq.Socket[bytes], client: RpcClient, data: bytes) -> dict[str, Callable[[], object]]:
    def raw_rtt() -> None:
        raw.send(data)
        raw.recv()

    return {
        "raw": raw_rtt,
        "ping": lambda: client.request(m.Ping(data), timeout=5),
        "echo": lambda: client.request(m.Echo(data), timeout=5),
        "future": lambda: client.call(m.Ping(data), timeout=5).result().unwrap(),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--sizes", default="64,4096")
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    tmp = tempfile.mkdtemp(prefix="kvb-", dir="/tmp")
    raw_ep = f"ipc://{tmp}/raw.sock"
    raw_server = subprocess.Popen([sys.executable, "-c", RAW_ECHO, raw_ep], stdout=subprocess.PIPE, text=True)
    assert raw_server.stdout is not None and raw_server.stdout.readline().strip() == "ready"
    raw: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(raw_ep)
    cluster = launch([RoleConfig("host_tier")], cluster_name="ipcbench", runtime_dir=f"{tmp}/c")
    client = cluster.client("host_tier")
    results: dict[tuple[int, str], list[float]] = {}
    try:
        for size in sizes:
            cases = _cases(raw, client, os.urandom(size))
            for fn in cases.values():
                timed(fn, 300)  # warm-up
            for _ in range(args.rounds):
                for name, fn in cases.items():
                    results.setdefault((size, name), []).extend(timed(fn, args.n // args.rounds))
    finally:
        raw.send(b"stop")
        raw.close()
        raw_server.wait(5)
        cluster.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
    load = os.getloadavg()[0]
    print(f"# IPC round trip, {args.n} calls per cell, {args.rounds} alternating rounds, ipc://, load {load:.2f}")
    names = ("raw", "ping", "echo", "future")
    print(
        "| payload | " + " | ".join(f"{k} median / p99 (us)" for k in names) + " | ping/raw | echo/raw | future/raw |"
    )
    print("|---" * 8 + "|")
    for size in sizes:
        cells = [results[(size, k)] for k in names]
        med = [statistics.median(c) for c in cells]
        row = [
            f"{size} B",
            *(f"{md:.0f} / {p99(c):.0f}" for md, c in zip(med, cells, strict=True)),
            *(f"{x / med[0]:.2f}x" for x in med[1:]),
        ]
        print("| " + " | ".join(row) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
