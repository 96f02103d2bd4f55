"""`kvproc console`: the debugging surface of a running cluster, found through its manifest.

    kvproc console status [--json] [--watch [SECONDS]]   every process: role, pid, uptime, RSS, queues, msgs, errors,
                                                          and each role's own counters
    kvproc console profile ROLE [--rank N] [--seconds N]  the process samples its own stacks while it keeps serving
                                                          and writes a report; its path is printed
    kvproc console top [--interval S] [--frames N] [--json]  rates, occupancy and per-process CPU/RSS, redrawn in
                                                          place (`runtime/top.py`)

All take `--cluster NAME` (default "default") or `--runtime-dir DIR`.
"""

from __future__ import annotations

import argparse
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec

from kvproc.ipc import messages as m
from kvproc.ipc.client import RpcClient
from kvproc.ipc.errors import IpcError, RemoteError
from kvproc.runtime import manifest as mf
from kvproc.runtime.histogram import is_histogram_key


def _targets(manifest: mf.Manifest) -> list[tuple[str, int, int, str, str]]:
    rows = [("launcher", 0, manifest.launcher_pid, manifest.control_endpoint, "up")]
    rows += [(p.role, p.rank, p.pid, p.endpoint, p.state) for p in manifest.processes]
    return rows


def _stats(endpoint: str, token: str, label: str, timeout: float) -> m.StatsReport:
    client = RpcClient(endpoint, token=token, name="console", peer=label, heartbeat_s=None)
    try:
        client.connect(timeout)
        report: m.StatsReport = client.request(m.Stats(), timeout=timeout)
        return report
    finally:
        client.close()


def collect(runtime_dir: str, timeout: float = 2.0) -> list[dict[str, Any]]:
    """One row per process; a process that does not answer is listed with its error, never skipped."""
    manifest = mf.read_manifest(runtime_dir)
    token = mf.read_token(runtime_dir)

    def row(target: tuple[str, int, int, str, str]) -> dict[str, Any]:
        role, rank, pid, endpoint, state = target
        base: dict[str, Any] = {"role": role, "rank": rank, "pid": pid, "state": state}
        if state != "up" or not endpoint:
            return base
        try:
            report = _stats(endpoint, token, f"{role}[{rank}]", timeout)
        except RemoteError as e:  # it answered: its Stats failed (`bad_counter`, `undecodable_reply`, ...)
            return {**base, "state": "stats_error", "error": str(e), "error_code": e.code}
        except IpcError as e:  # no answer: down, hung, or not a kvproc peer
            return {**base, "state": "unreachable", "error": str(e)}
        return {**base, **msgspec.structs.asdict(report)}

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(row, _targets(manifest)))


# (title, stats key, width, kind): kind "s" left-aligned text, "f" one decimal, "d" right-aligned integer
_COLUMNS = [
    ("ROLE", "role", 12, "s"), ("RANK", "rank", 4, "d"), ("PID", "pid", 8, "d"), ("STATE", "state", 11, "s"),
    ("UPTIME_S", "uptime_s", 9, "f"), ("RSS_MiB", "rss_mib", 8, "f"), ("INFLT", "in_flight", 5, "d"),
    ("QUEUED", "queued", 6, "d"), ("OUTBOX", "outbox", 6, "d"), ("MSG_IN", "msgs_in", 8, "d"),
    ("MSG_OUT", "msgs_out", 8, "d"), ("ERR", "errors", 5, "d"),
]  # fmt: skip


def _cell(value: Any, width: int, kind: str) -> str:
    if value is None:
        return "-".rjust(width) if kind != "s" else "-".ljust(width)
    if kind == "s":
        return f"{value:<{width}}"
    return f"{value:>{width}.1f}" if kind == "f" else f"{value:>{width}}"


def render(rows: list[dict[str, Any]]) -> str:
    header = " ".join(t.ljust(w) if k == "s" else t.rjust(w) for t, _, w, k in _COLUMNS) + "  COUNTERS"
    lines = [header]
    for r in rows:
        values = {**r, "rss_mib": r["rss_bytes"] / 2**20 if "rss_bytes" in r else None}
        own = {k: v for k, v in sorted(r.get("counters", {}).items())
               if not k.startswith("ipc.") and not is_histogram_key(k)}  # buckets: in --json and /metrics
        extra = " ".join(f"{k}={v}" for k, v in own.items()) or r.get("error", "")
        lines.append(" ".join(_cell(values.get(key), w, k) for _, key, w, k in _COLUMNS) + "  " + extra)
    return "\n".join(lines)


def _runtime_dir(args: argparse.Namespace) -> str:
    return mf.find_runtime_dir(args.cluster, args.runtime_dir)


def status(args: argparse.Namespace) -> int:
    runtime_dir = _runtime_dir(args)
    while True:
        rows = collect(runtime_dir, timeout=args.timeout)
        if args.json:
            print(msgspec.json.encode(rows).decode(), flush=True)
        else:
            if args.watch:
                print("\x1b[2J\x1b[H", end="")
            print(render(rows), flush=True)
        if not args.watch:
            return 0 if all(r["state"] == "up" for r in rows) else 1
        try:
            time.sleep(args.watch)
        except KeyboardInterrupt:
            return 0


def top(args: argparse.Namespace) -> int:
    from kvproc.runtime import top as tp

    runtime_dir = _runtime_dir(args)
    cluster = mf.read_manifest(runtime_dir).cluster
    in_place = not args.json and sys.stdout.isatty()  # a pipe or a file gets the frames one after the other

    def read() -> list[dict[str, Any]]:
        return collect(runtime_dir, timeout=args.timeout)

    try:
        prev, shown = tp.take(read), 0
        while not args.frames or shown < args.frames:
            time.sleep(max(0.0, args.interval - (time.monotonic() - prev.at)))
            cur = tp.take(read)
            f = tp.frame(prev, cur)
            if args.json:
                print(msgspec.json.encode(f).decode(), flush=True)
            else:
                text = tp.render(cluster, f)
                if in_place:  # home, each line cleared to its end, then below: redrawn over itself, no blank flash
                    text = (("\x1b[2J" if not shown else "") + "\x1b[H" + "\x1b[K\n".join(text.splitlines())
                            + "\x1b[K\x1b[J")
                print(text if in_place else text + "\n", flush=True)
            prev, shown = cur, shown + 1
    except KeyboardInterrupt:
        pass
    return 0


def profile(args: argparse.Namespace) -> int:
    runtime_dir = _runtime_dir(args)
    manifest = mf.read_manifest(runtime_dir)
    match = [t for t in _targets(manifest) if t[0] == args.role and t[1] == args.rank]
    if not match:
        known = ", ".join(f"{t[0]}[{t[1]}]" for t in _targets(manifest))
        print(f"kvproc console: no process {args.role}[{args.rank}] in {runtime_dir} (known: {known})", file=sys.stderr)
        return 2
    role, rank, pid, endpoint, _ = match[0]
    client = RpcClient(endpoint, token=mf.read_token(runtime_dir), name="console", peer=f"{role}[{rank}]")
    try:
        client.connect(args.timeout)
        report = client.request(m.Profile(args.seconds), timeout=args.seconds + 10.0)
    except IpcError as e:
        print(f"kvproc console: profiling {role}[{rank}] pid {pid} failed: {e}", file=sys.stderr)
        return 1
    finally:
        client.close()
    print(report.path)
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvproc console", description=__doc__.splitlines()[0] if __doc__ else "")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("status", "profile", "top"):
        p = sub.add_parser(name)
        p.add_argument("--cluster", default="default")
        p.add_argument("--runtime-dir", default=None)
        p.add_argument("--timeout", type=float, default=2.0, help="per-process connect/answer timeout (s)")
        if name == "status":
            p.add_argument("--json", action="store_true", help="one JSON array per refresh")
            p.add_argument("--watch", type=float, nargs="?", const=2.0, default=None, help="refresh every N s")
        elif name == "top":
            p.add_argument("--json", action="store_true", help="one JSON object per frame, one per line")
            p.add_argument("--interval", type=float, default=1.0, help="seconds between frames (rates over it)")
            p.add_argument("--frames", type=int, default=0, help="stop after N frames (0: until interrupted)")
        else:
            p.add_argument("role")
            p.add_argument("--rank", type=int, default=0)
            p.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args(argv)
    try:
        return {"status": status, "profile": profile, "top": top}[args.command](args)
    except FileNotFoundError as e:
        print(f"kvproc console: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `kvproc console status --watch | head`: the reader left, which is not an error
        sys.stderr.close()
        return 0
