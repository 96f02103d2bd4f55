"""`kvproc up` / `kvproc down`: a standalone host tier that several engines on one node share.

kvproc up   [--cluster NAME] [--runtime-dir DIR] [--tcp tcp://127.0.0.1:PORT] [--host-mib N] [--ranks N]
            [--eviction lru|lfu|lrfu]
    runs in the foreground until `kvproc down`, SIGTERM or Ctrl-C; engines attach through the manifest
    (ipc, or tcp with the auth token from the runtime dir). `--ranks N` runs one host tier per rank (`host_tier[r]`,
    `--host-mib` each): engines of N ranks (tensor-parallel shards) attach rank r to tier r, since a tier's keys carry
    no rank. With `--tcp`, rank r listens on PORT + r (port 0: each picks a free port).
kvproc down [--cluster NAME] [--runtime-dir DIR] [--timeout S] [--force]
    asks the cluster's launcher (any launcher: `kvproc up` or an engine) for an orderly shutdown through its
    control endpoint and waits until the cluster's runtime dir is gone, then says what became of the dir (removed;
    a dir the launcher left behind is removed only if it carries kvproc's marker and its launcher is provably dead);
    `--force` then SIGKILLs what is left: only processes that are still the ones the launcher recorded (same pid and
    start time), every other pid is reported and never signalled

Runtime dirs: `--runtime-dir DIR` must be new, empty, or one kvproc marked (`.kvproc-runtime`); a non-empty dir
without the marker is refused, and nothing unmarked is ever deleted.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import Any

from kvproc.core.eviction import HOST_DEFAULT, POLICIES
from kvproc.ipc import messages as m
from kvproc.ipc.client import RpcClient
from kvproc.ipc.errors import IpcError
from kvproc.runtime import manifest as mf
from kvproc.runtime.event_interval import DEFAULT_INTERVAL_S, MAX_INTERVAL_S, check_interval
from kvproc.runtime.logs import configure_logging


def up_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvproc up", description="start a standalone host tier")
    parser.add_argument("--cluster", default="default")
    parser.add_argument("--runtime-dir", default=None)
    parser.add_argument("--tcp", default=None, help="also serve on this tcp endpoint (auth token required)")
    parser.add_argument("--host-mib", type=int, default=1024,
                        help="the host tier's byte budget (MiB); the first engine's Configure sizes the arena within it")
    parser.add_argument("--lease-ttl", type=float, default=30.0, help="seconds before a forgotten lease is reclaimed")
    parser.add_argument("--handoff-ttl", type=float, default=300.0,
                        help="seconds before a forgotten hand-off is reclaimed")
    parser.add_argument("--ranks", type=int, default=1, help="host tiers to run, one per rank of the engines")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--shutdown-deadline", type=float, default=5.0)
    parser.add_argument("--kv-events", action="store_true",
                        help="publish KV events (pages stored/removed) on ipc://<runtime dir>/kv-events-<rank>")
    parser.add_argument("--kv-events-interval-ms", type=float, default=DEFAULT_INTERVAL_S * 1000, metavar="MS",
                        help="how long a KV-event batch gathers changes (default 50; at most 3600000, one hour): "
                             "shorter, routers learn sooner and the publisher wakes more often")
    parser.add_argument("--kv-events-tokens", action="store_true",
                        help="put the pages' token ids in BlockStored (each save then carries its tokens here)")
    parser.add_argument("--remote", default="", metavar="mooncake://HOST:PORT?metadata=URL",
                        help="a Mooncake Store below the host tier: committed pages written behind to it, host-tier "
                             "misses pulled from it (needs kvproc[remote]; see docs/remote.md)")
    parser.add_argument("--eviction", default=HOST_DEFAULT, choices=POLICIES,
                        help=f"the host tiers' eviction policy (kvproc.core.eviction; default {HOST_DEFAULT}): a "
                             "shared tier keeps its own, whatever the attaching stores' StoreConfig.eviction says")
    parser.add_argument("--metrics", default=None, metavar="HOST:PORT",
                        help="serve Prometheus /metrics of every process here (port 0: a free one)")
    args = parser.parse_args(argv)
    if args.ranks < 1:
        parser.error(f"--ranks must be >= 1, got {args.ranks}")
    if args.kv_events_tokens and not args.kv_events:
        parser.error("--kv-events-tokens puts token ids in the KV events: it needs --kv-events")
    try:  # here, not in the tier's process: a bad value is a usage error, not a failed start
        interval_s = check_interval(args.kv_events_interval_ms / 1000)
    except ValueError:
        parser.error(f"--kv-events-interval-ms must be > 0 and <= {MAX_INTERVAL_S * 1000:g}, "
                     f"got {args.kv_events_interval_ms:g}")
    configure_logging("launcher", 0, level=args.log_level)

    from kvproc.runtime.launcher import RoleConfig, launch

    options = {"host_bytes": args.host_mib << 20, "lease_ttl_s": args.lease_ttl, "handoff_ttl_s": args.handoff_ttl,
               "kv_events": args.kv_events, "kv_events_interval_s": interval_s,
               "kv_events_tokens": args.kv_events_tokens, "remote": args.remote, "eviction": args.eviction}
    try:
        cluster = launch(
            [RoleConfig("host_tier", r, tcp=_rank_tcp(args.tcp, r), options=options) for r in range(args.ranks)],
            cluster_name=args.cluster,
            runtime_dir=args.runtime_dir,
            metrics=args.metrics,
        )
    except (mf.RuntimeDirError, mf.ClusterRunningError, PermissionError, OSError, ValueError) as e:
        print(f"kvproc up: {e}", file=sys.stderr)
        return 2
    wake = threading.Event()

    def on_signal(*_: Any) -> None:
        wake.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def on_cluster_stopped() -> None:  # `kvproc down` stopped the cluster through the control endpoint
        cluster.stopped.wait()
        wake.set()

    threading.Thread(target=on_cluster_stopped, daemon=True).start()
    print(f"kvproc: cluster {args.cluster!r} up; manifest {cluster.manifest_path}"
          + (f"; metrics http://{cluster.metrics.address}/metrics" if cluster.metrics else ""), flush=True)
    wake.wait()
    cluster.shutdown(args.shutdown_deadline)
    removal = cluster.runtime_dir_removal
    print(f"kvproc: cluster {args.cluster!r} down" + (f"; {removal.message}" if removal else ""), flush=True)
    return 0


def _rank_tcp(endpoint: str | None, rank: int) -> str | None:
    """Rank r's tcp endpoint: the given port + r (0 stays 0: any free port)."""
    if not endpoint or rank == 0:
        return endpoint
    base, _, port = endpoint.rpartition(":")
    if not port.isdigit():
        raise SystemExit(f"kvproc up: --tcp wants tcp://HOST:PORT, got {endpoint!r}")
    return f"{base}:{int(port) + rank if int(port) else 0}"


def _launcher_identity(manifest: mf.Manifest, runtime_dir: str) -> mf.ProcessIdentity | None:
    if manifest.launcher_identity is not None:
        return manifest.launcher_identity
    marker = mf.read_marker(runtime_dir)  # a manifest written before identities were recorded
    if marker is not None and marker.launcher is not None and marker.launcher.pid == manifest.launcher_pid:
        return marker.launcher
    return None


def _gone(runtime_dir: str, launcher_pid: int, launcher: mf.ProcessIdentity | None = None) -> bool:
    if not os.path.exists(os.path.join(runtime_dir, "manifest.json")):
        return True
    if launcher is not None:
        return mf.process_state(launcher) == "gone"  # a pid reused by another process does not keep it "running"
    try:
        os.kill(launcher_pid, 0)
    except ProcessLookupError:
        return True
    return False


def _runtime_dir_outcome(runtime_dir: str, launcher: mf.ProcessIdentity | None, until: float) -> str:
    """What became of the runtime dir: the launcher removes it as the last step of its shutdown (wait for that until
    `until`); one a dead launcher left behind is removed here, if marked and its launcher is provably dead."""
    while (
        mf.read_marker(runtime_dir) is not None and mf.process_state(launcher) != "gone" and time.monotonic() < until
    ):
        time.sleep(0.05)  # a CLI waiting for another process to finish; not a hot path
    if not os.path.lexists(runtime_dir):
        return f"removed runtime dir {runtime_dir}"
    if mf.read_marker(runtime_dir) is None:
        try:
            empty = not os.listdir(runtime_dir)
        except OSError:
            empty = False
        if empty:
            return f"emptied runtime dir {runtime_dir} (kept the directory: it existed before kvproc)"
        return f"kept runtime dir {runtime_dir}: it has no {mf.RUNTIME_MARKER} marker, so kvproc did not create it"
    return mf.remove_runtime_dir(runtime_dir).message


def _force_kill(manifest: mf.Manifest, launcher: mf.ProcessIdentity | None) -> tuple[list[str], list[str]]:
    """SIGKILL every recorded process that is still the one recorded; returns (killed, skipped with the reason)."""
    targets = [(f"{p.role}[{p.rank}]", p.pid, p.identity) for p in manifest.processes]
    targets.append(("launcher", manifest.launcher_pid, launcher))
    killed: list[str] = []
    skipped: list[str] = []
    for label, pid, identity in targets:
        if identity is not None and identity.pid != pid:
            identity = None
        state = mf.signal_if_same(identity, signal.SIGKILL)
        if state == "running":
            killed.append(f"{label} pid {pid}")
        elif state == "gone":
            skipped.append(f"{label} pid {pid}: not the process kvproc started any more (it exited, or the pid "
                           "now belongs to another process)")
        else:
            skipped.append(f"{label} pid {pid}: cannot verify it is the process kvproc started (no identity "
                           "recorded, or recorded in another pid namespace)")
    return killed, skipped


def down_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvproc down", description="orderly shutdown of a running cluster")
    parser.add_argument("--cluster", default="default")
    parser.add_argument("--runtime-dir", default=None)
    parser.add_argument("--timeout", type=float, default=10.0)
    parser.add_argument("--force", action="store_true",
                        help="after the timeout, SIGKILL the launcher and children that are still the processes "
                             "recorded at launch (same pid and start time); other pids are reported, not signalled")
    args = parser.parse_args(argv)
    try:
        runtime_dir = mf.find_runtime_dir(args.cluster, args.runtime_dir)
    except FileNotFoundError as e:
        path = args.runtime_dir or mf.default_runtime_dir(args.cluster)
        if mf.read_marker(path) is not None:  # a launcher that died before writing its manifest
            removal = mf.remove_runtime_dir(path)
            if removal.done:
                print(f"kvproc down: no running cluster {args.cluster!r}; {removal.message}")
                return 0
        print(f"kvproc down: {e}", file=sys.stderr)
        return 2
    manifest = mf.read_manifest(runtime_dir)
    launcher = _launcher_identity(manifest, runtime_dir)
    if not _gone(runtime_dir, manifest.launcher_pid, launcher):
        client = RpcClient(manifest.control_endpoint, token=mf.read_token(runtime_dir), name="down", peer="launcher")
        try:
            client.connect(2.0)
            client.request(m.Shutdown("kvproc down"), timeout=5.0)
        except IpcError as e:
            print(f"kvproc down: launcher pid {manifest.launcher_pid} did not take the request: {e}", file=sys.stderr)
        finally:
            client.close()
    end = time.monotonic() + args.timeout
    while not _gone(runtime_dir, manifest.launcher_pid, launcher) and time.monotonic() < end:
        time.sleep(0.05)  # a CLI waiting for another process to finish; not a hot path
    if _gone(runtime_dir, manifest.launcher_pid, launcher):
        outcome = _runtime_dir_outcome(runtime_dir, launcher, max(end, time.monotonic() + 2.0))
        print(f"kvproc down: cluster {manifest.cluster!r} stopped; {outcome}")
        return 0
    if not args.force:
        print(f"kvproc down: cluster {manifest.cluster!r} still running after {args.timeout:.1f}s", file=sys.stderr)
        return 1
    killed, skipped = _force_kill(manifest, launcher)
    for line in skipped:
        print(f"kvproc down: not signalled: {line}", file=sys.stderr)
    outcome = _runtime_dir_outcome(runtime_dir, launcher, time.monotonic() + 2.0)
    print(f"kvproc down: cluster {manifest.cluster!r} killed (--force): SIGKILL to "
          f"{', '.join(killed) if killed else 'nothing'}; {outcome}", file=sys.stderr)
    return 1
