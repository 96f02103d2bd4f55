"""The debugging surface: console status/profile against a live cluster, and `kvproc up` / `kvproc down`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import psutil
import pytest

from kvproc.ipc import messages as m
from kvproc.ipc.client import RpcClient
from kvproc.ipc.errors import HandshakeRefused
from kvproc.ipc.segment import list_segments
from kvproc.runtime import Cluster, RoleConfig, console, launch, standalone
from kvproc.runtime import manifest as mf

# Unique to this test process: the segment checks below count by cluster name, and another pytest run on the same
# machine (same /dev/shm) must not be counted.
UPT_CLUSTER = f"upt{os.getpid()}"


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    roles = [RoleConfig("host_tier", options={"segment_bytes": 4096}), RoleConfig("copy_worker")]
    c = launch(roles, cluster_name="cs", runtime_dir=f"/tmp/kvcs-{os.getpid()}")
    try:
        yield c
    finally:
        c.shutdown()


def test_status_json_lists_every_process_with_its_counters(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    cluster.client("host_tier").request(m.Sleep(0.01), timeout=5)  # bump a role counter
    assert console.main(["status", "--json", "--runtime-dir", cluster.runtime_dir]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["role"], r["rank"], r["state"]) for r in rows] == [
        ("launcher", 0, "up"), ("host_tier", 0, "up"), ("copy_worker", 0, "up"),
    ]  # fmt: skip
    host = rows[1]
    assert host["pid"] == cluster.pid("host_tier") and host["rss_bytes"] > 0 and host["uptime_s"] > 0
    assert host["counters"]["sleeps"] >= 1 and host["msgs_in"] >= 1 and len(host["segments"]) == 1
    assert rows[0]["counters"]["children_up"] == 2


def test_status_table_names_roles_and_shows_unavailable_processes(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    assert console.main(["status", "--runtime-dir", cluster.runtime_dir]) == 0
    out = capsys.readouterr().out
    assert "ROLE" in out and "host_tier" in out and "copy_worker" in out and "sleeps=" in out


def test_profile_writes_a_report_while_the_process_keeps_serving(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    client = cluster.client("host_tier")
    served: list[float] = []
    stop = threading.Event()

    def keep_calling() -> None:
        while not stop.is_set():
            t0 = time.monotonic()
            client.request(m.Stats(), timeout=5)
            served.append(time.monotonic() - t0)

    caller = threading.Thread(target=keep_calling)
    caller.start()
    try:
        rc = console.main(["profile", "host_tier", "--seconds", "0.5", "--runtime-dir", cluster.runtime_dir])
    finally:
        stop.set()
        caller.join(10)
    assert rc == 0
    path = capsys.readouterr().out.strip()
    report = open(path).read()
    assert "samples over" in report and "collapsed stacks" in report and "serve" in report
    assert len(served) > 10 and max(served) < 0.5  # served throughout, never blocked by the profiler


def test_console_reports_a_missing_cluster_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    assert console.main(["status", "--runtime-dir", "/tmp/kv-no-such-cluster"]) == 2
    assert "no running cluster" in capsys.readouterr().err


def _up(runtime_dir: str, *extra: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvproc", "up", "--cluster", UPT_CLUSTER, "--runtime-dir", runtime_dir, *extra],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    assert proc.stdout is not None
    line = proc.stdout.readline()  # printed once the cluster is up
    assert "up; manifest" in line, line
    return proc


_CONFIGURE = m.Configure("test-fingerprint", m.HostLayoutSpec([m.RegionSpec("kv", "kv", 0, 4096, 16)], 16, {}, 65536))


def test_up_then_down_leaves_no_process_and_no_segment() -> None:
    runtime_dir = f"/tmp/kvup-{os.getpid()}"
    proc = _up(runtime_dir, "--host-mib", "1", "--tcp", "tcp://127.0.0.1:0")
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        assert console.main(["status", "--runtime-dir", runtime_dir]) == 0
        tcp = mf.read_manifest(runtime_dir).processes[0].tcp
        assert tcp.startswith("tcp://127.0.0.1:")
        engine = RpcClient(tcp, token=mf.read_token(runtime_dir), peer="shared host tier")  # a second engine
        engine.connect(5)
        assert engine.request(m.Ping(b"tcp"), timeout=5).data == b"tcp"
        engine.request(_CONFIGURE, timeout=5)  # the first engine's Configure creates the host arena
        assert len(list_segments(UPT_CLUSTER)) == 1
        engine.close()
        with pytest.raises(HandshakeRefused):
            RpcClient(tcp, token="guess", peer="intruder").connect(5)
        assert standalone.down_main(["--runtime-dir", runtime_dir, "--timeout", "10"]) == 0
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    assert not list_segments(UPT_CLUSTER) and not os.path.exists(runtime_dir)
    _, alive = psutil.wait_procs(children, timeout=5)  # forkserver and resource tracker follow their launcher out
    assert not alive, f"left behind: {alive}"


def test_children_die_with_a_sigkilled_launcher() -> None:
    runtime_dir = f"/tmp/kvup-{os.getpid()}"
    proc = _up(runtime_dir, "--host-mib", "1")
    try:
        engine = RpcClient(f"ipc://{runtime_dir}/host_tier-0.sock", token=mf.read_token(runtime_dir), peer="tier")
        engine.connect(5)
        engine.request(_CONFIGURE, timeout=5)
        engine.close()
        assert len(list_segments(UPT_CLUSTER)) == 1
        children = psutil.Process(proc.pid).children(recursive=True)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(5)
        gone, alive = psutil.wait_procs(children, timeout=5)
        assert not alive, f"children outlived their launcher: {alive}"
        assert not list_segments(UPT_CLUSTER)  # they stopped in order and unlinked their segments
    finally:
        for c in psutil.Process().children(recursive=True):
            if c.pid == proc.pid:
                c.kill()
        import shutil

        shutil.rmtree(runtime_dir, ignore_errors=True)


def test_status_tells_a_process_whose_stats_failed_from_one_that_does_not_answer(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A role whose Stats fails (here a non-int counter: `bad_counter`) answered: `stats_error` with the error and
    its code, not `unreachable`, which is for an endpoint nobody serves. Real server over ipc:// in this process."""
    from kvproc.ipc.server import RpcServer
    from kvproc.ipc.sockets import ipc_endpoint
    from kvproc.runtime.role import Role, RoleEnv

    rd = str(tmp_path)
    token = mf.write_token(rd)
    role = Role(RoleEnv("c", "host_tier", 0, rd))
    role.counters.set("busy_s", 0.5)  # type: ignore[arg-type]  # what `bad_counter` guards against
    served, nobody = ipc_endpoint(rd, "served"), ipc_endpoint(rd, "nobody")
    srv = RpcServer(role, endpoints=[served], token=token, role="host_tier", workers=2)
    srv.bind()
    thread = srv.start()
    try:
        mf.write_manifest(rd, mf.Manifest(1, "c", rd, os.getpid(), time.time(), processes=[
            mf.ProcessEntry("host_tier", 0, os.getpid(), served), mf.ProcessEntry("copy_worker", 0, 1, nobody)]))
        assert console.main(["status", "--json", "--runtime-dir", rd, "--timeout", "5"]) == 1
        rows = {r["role"]: r for r in json.loads(capsys.readouterr().out)}
        assert rows["host_tier"]["state"] == "stats_error" and rows["host_tier"]["error_code"] == "bad_counter"
        assert "busy_s=0.5" in rows["host_tier"]["error"]
        assert rows["copy_worker"]["state"] == "unreachable" and "error_code" not in rows["copy_worker"]
        assert console.main(["status", "--runtime-dir", rd, "--timeout", "5"]) == 1  # the table shows both
        out = capsys.readouterr().out
        assert "stats_error" in out and "bad_counter" in out and "unreachable" in out
    finally:
        srv.stop()
        thread.join(10)
