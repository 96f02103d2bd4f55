"""The launcher across real processes: start-up, ping/stats from every process, crashes, restarts, shutdown."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from kvproc.ipc import messages as m
from kvproc.ipc.cancel import new_token
from kvproc.ipc.client import RpcClient
from kvproc.ipc.errors import PeerDeadError
from kvproc.ipc.segment import list_segments
from kvproc.runtime import ClusterStartError, RoleConfig, launch
from kvproc.runtime import manifest as mf

SEG = 64 * 1024
# Cluster names of this test process only: the fixture below counts segments by cluster name, and another pytest run on
# the same machine (same /dev/shm) must neither fail this one nor be failed by it.
LT = f"lt{os.getpid()}"
CLUSTERS = (LT, LT + "stall", LT + "rate")


# The forkserver and resource tracker live as long as this test process (shared by every launch); nothing else may.
_SHARED = ("multiprocessing.forkserver", "multiprocessing.resource_tracker")


def _descendants() -> set[int]:
    procs = psutil.Process().children(recursive=True)
    return {p.pid for p in procs if not any(s in " ".join(p.cmdline()) for s in _SHARED)}


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    before = _descendants()
    yield
    deadline = time.monotonic() + 5
    while (left := _descendants() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes left behind: {left}"
    left_segments = [name for c in CLUSTERS for name in list_segments(c)]
    assert not left_segments, f"segments left behind: {left_segments}"


def _roles(**kw: object) -> list[RoleConfig]:
    return [
        RoleConfig("host_tier", options={"segment_bytes": SEG}),
        RoleConfig("copy_worker", 0, options={"segment_bytes": SEG}, **kw),  # type: ignore[arg-type]
        RoleConfig("copy_worker", 1, **kw),  # type: ignore[arg-type]
    ]


def test_cluster_answers_ping_and_stats_from_every_process_and_leaves_nothing_behind() -> None:
    with launch(_roles(), cluster_name=LT, runtime_dir=f"/tmp/kvlt-{os.getpid()}") as cluster:
        manifest = mf.read_manifest(cluster.runtime_dir)
        assert {(p.role, p.rank) for p in manifest.processes} == {
            ("host_tier", 0),
            ("copy_worker", 0),
            ("copy_worker", 1),
        }
        assert os.stat(cluster.runtime_dir).st_mode & 0o777 == 0o700
        assert os.stat(os.path.join(cluster.runtime_dir, "token")).st_mode & 0o777 == 0o600
        for p in manifest.processes:
            client = cluster.client(p.role, p.rank)
            assert client.request(m.Ping(b"hi"), timeout=5) == m.Pong(b"hi", p.pid)
            report = client.request(m.Stats(), timeout=5)
            assert (report.role, report.rank, report.pid) == (p.role, p.rank, p.pid)
            assert psutil.Process(p.pid).name().startswith(f"kvproc:{LT}:")  # the process title names the role
        assert len(list_segments(LT)) == 2
        control = RpcClient(manifest.control_endpoint, token=cluster.token, peer="launcher")
        control.connect(5)
        assert control.request(m.Stats(), timeout=5).counters["children_up"] == 3
        control.close()
        runtime_dir = cluster.runtime_dir
    assert not os.path.exists(runtime_dir)


def test_sigkill_fails_pending_calls_with_peer_dead_and_copy_worker_restarts() -> None:
    with launch(_roles(), cluster_name=LT, runtime_dir=f"/tmp/kvlt-{os.getpid()}") as cluster:
        victim = cluster.client("copy_worker", 0)
        old_pid = cluster.pid("copy_worker", 0)
        futs = [victim.call(m.Sleep(30.0), timeout=30) for _ in range(8)]
        time.sleep(0.2)
        t0 = time.monotonic()
        os.kill(old_pid, signal.SIGKILL)
        replies = [f.result(5) for f in futs]
        elapsed = time.monotonic() - t0
        assert all(isinstance(r, m.PeerDead) for r in replies), replies
        assert elapsed < 2.5, f"PeerDead took {elapsed:.3f}s"  # the sentinel, not the 3 s heartbeat timeout
        assert "SIGKILL" in replies[0].reason
        with pytest.raises(PeerDeadError):
            victim.request(m.Ping(), timeout=1)
        new = cluster.wait_available("copy_worker", 0, timeout=15)
        assert cluster.pid("copy_worker", 0) != old_pid
        assert new.request(m.Ping(b"again"), timeout=5).data == b"again"
        assert [e.what for e in cluster.events] == ["crashed", "restarted"]
        assert all(not name.split(".")[3] == str(old_pid) for name in list_segments(LT))  # swept
        assert cluster.client("host_tier").request(m.Ping(), timeout=5)  # the others were never disturbed


def test_crashed_host_tier_is_marked_unavailable_and_calls_fail_fast() -> None:
    with launch(_roles(), cluster_name=LT, runtime_dir=f"/tmp/kvlt-{os.getpid()}") as cluster:
        os.kill(cluster.pid("host_tier"), signal.SIGKILL)
        deadline = time.monotonic() + 5
        while cluster.state("host_tier") != "unavailable" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert cluster.state("host_tier") == "unavailable" and not cluster.available("host_tier")
        t0 = time.monotonic()
        reply = cluster.client("host_tier").call(m.Ping(), timeout=10).result(1)
        assert isinstance(reply, m.PeerDead) and time.monotonic() - t0 < 0.1
        assert mf.read_manifest(cluster.runtime_dir).processes[0].state == "unavailable"


def test_explicit_restart_replaces_a_live_worker() -> None:
    with launch(_roles(), cluster_name=LT, runtime_dir=f"/tmp/kvlt-{os.getpid()}") as cluster:
        old = cluster.pid("copy_worker", 1)
        client = cluster.restart("copy_worker", 1)
        assert cluster.pid("copy_worker", 1) != old and client.request(m.Ping(), timeout=5).pid != old
        assert cluster.events[-1].what == "restarted"


def test_cancel_reaches_a_request_waiting_in_a_child() -> None:
    with launch(_roles()[:1], cluster_name=LT, runtime_dir=f"/tmp/kvlt-{os.getpid()}") as cluster:
        token = new_token()
        fut = cluster.client("host_tier").call(m.Sleep(20.0), timeout=20, cancel_token=token)
        time.sleep(0.2)
        token.cancel()
        assert isinstance(fut.result(3), m.Cancelled)


def test_child_that_fails_to_start_is_named_in_the_error_and_nothing_is_left() -> None:
    bad = RoleConfig("copy_worker", 0, options={"segment_bytes": -1})
    with pytest.raises(ClusterStartError, match=r"copy_worker\[0\].*failed to start"):
        launch([RoleConfig("host_tier"), bad], cluster_name=LT, runtime_dir=f"/tmp/kvlt-{os.getpid()}")


def test_shutdown_escalates_to_sigkill_for_a_child_that_ignores_messages_and_sigterm() -> None:
    cluster = launch(_roles()[:2], cluster_name=LT, runtime_dir=f"/tmp/kvlt-{os.getpid()}")
    stuck = cluster.pid("copy_worker", 0)
    os.kill(stuck, signal.SIGSTOP)  # a hung process: answers nothing, handles no signal but SIGKILL
    t0 = time.monotonic()
    cluster.shutdown(deadline_s=1.0)
    assert time.monotonic() - t0 < 4.0
    assert not psutil.pid_exists(stuck) or psutil.Process(stuck).status() == psutil.STATUS_ZOMBIE


ENGINE_SCRIPT = """
import os
from kvproc.ipc import messages as m
from kvproc.runtime import RoleConfig, launch

print("engine script ran", flush=True)  # no `if __name__ == "__main__"` guard, on purpose
with launch([RoleConfig("host_tier")], cluster_name=f"lg{os.getpid()}", runtime_dir=f"/tmp/kvlg-{os.getpid()}") as c:
    print("pong", c.client("host_tier").request(m.Ping(), timeout=5).pid > 0, flush=True)
"""


def test_children_do_not_rerun_a_launcher_script_without_main_guard(tmp_path: pathlib.Path) -> None:
    script = tmp_path / "engine.py"
    script.write_text(ENGINE_SCRIPT)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("engine script ran") == 1 and "pong True" in out.stdout


def _thread_cpus(pid: int) -> list[set[int]]:
    return [os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")]


def test_a_pinned_child_runs_every_thread_on_its_cpus_and_keeps_them_across_a_restart() -> None:
    """`RoleConfig.cpus`: the child pins itself before any thread starts, so ZeroMQ's I/O thread, the handler pool
    and the parent watcher all inherit it; a restarted incarnation is pinned again. The unpinned role is not."""
    last = max(os.sched_getaffinity(0))
    roles = [RoleConfig("host_tier"), RoleConfig("copy_worker", 0, cpus=(last,))]
    with launch(roles, cluster_name=LT, runtime_dir=f"/tmp/kvlt-{os.getpid()}") as cluster:
        for _ in range(2):
            pid = cluster.pid("copy_worker", 0)
            cluster.client("copy_worker", 0).request(m.Stats(), timeout=5)  # the handler pool has run a call
            threads = _thread_cpus(pid)
            assert len(threads) > 2 and all(c == {last} for c in threads), threads
            cluster.restart("copy_worker", 0)
        assert all(c == os.sched_getaffinity(0) for c in _thread_cpus(cluster.pid("host_tier", 0)))


def test_cpus_outside_the_machine_are_refused_before_anything_starts() -> None:
    with pytest.raises(ValueError, match=r"copy_worker\[0\]: cpus \[100000\] must be a non-empty subset"):
        launch([RoleConfig("copy_worker", 0, cpus=(100_000,))], cluster_name=LT,
               runtime_dir=f"/tmp/kvlt-{os.getpid()}")


def _crash_and_wait(cluster, rank: int) -> None:
    """SIGKILL copy_worker[rank] and wait until the launcher has restarted it or given it up (its events say)."""
    settled = sum(e.what in ("restarted", "unavailable") for e in cluster.events if e.rank == rank)
    os.kill(cluster.pid("copy_worker", rank), signal.SIGKILL)
    deadline = time.monotonic() + 15
    while sum(e.what in ("restarted", "unavailable") for e in cluster.events if e.rank == rank) == settled:
        assert time.monotonic() < deadline, "the crash was never handled"
        time.sleep(0.05)


def test_the_restart_budget_is_a_rate_not_a_lifetime_count() -> None:
    """Crashes further apart than the window never exhaust the budget; crashes inside it do (a lifetime count made the
    (max_restarts+1)-th crash of a long-lived cluster final)."""
    roles = [RoleConfig("copy_worker", 0, max_restarts=1, restart_window_s=1.0),
             RoleConfig("copy_worker", 1, max_restarts=1, restart_window_s=600.0)]
    with launch(roles, cluster_name=LT + "rate", runtime_dir=f"/tmp/kvlt-rate-{os.getpid()}") as cluster:
        for _ in range(3):  # rank 0: one crash per window, three times
            _crash_and_wait(cluster, 0)
            assert cluster.available("copy_worker", 0)
            time.sleep(1.2)  # the window passes: the last restart no longer counts
        assert cluster.wait_available("copy_worker", 0, 5).request(m.Ping(b"x"), timeout=5).data == b"x"
        _crash_and_wait(cluster, 1)  # rank 1 (control): two crashes inside its window exhaust the budget
        assert cluster.available("copy_worker", 1)
        _crash_and_wait(cluster, 1)
        assert not cluster.available("copy_worker", 1)
        assert [e.what for e in cluster.events if e.rank == 1] == ["crashed", "restarted", "crashed", "unavailable"]


def test_a_stalled_child_is_reconnected_when_it_answers_again_not_left_dead() -> None:
    """SIGSTOP a copy worker past the heartbeat liveness (3 s): its client is declared dead though the process lives.
    Before, that was final (`client()` kept returning the dead client, `available` stayed False); now the launcher
    reconnects it once it answers, same process, and says so in its events and the manifest."""
    with launch(_roles(), cluster_name=LT + "stall", runtime_dir=f"/tmp/kvlt-stall-{os.getpid()}") as cluster:
        pid = cluster.pid("copy_worker", 0)
        dead = cluster.client("copy_worker", 0)
        os.kill(pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 20
            while dead.alive:
                assert time.monotonic() < deadline, "the stalled worker was never declared dead"
                time.sleep(0.1)
        finally:
            os.kill(pid, signal.SIGCONT)
        client = cluster.wait_available("copy_worker", 0, timeout=20)
        assert client is not dead and client.request(m.Ping(b"back"), timeout=5).data == b"back"
        assert cluster.pid("copy_worker", 0) == pid  # reconnected, not restarted
        assert [e.what for e in cluster.events if e.rank == 0 and e.role == "copy_worker"] == \
            ["unresponsive", "reconnected"]
        states = {(p.role, p.rank): p.state for p in mf.read_manifest(cluster.runtime_dir).processes}
        assert states[("copy_worker", 0)] == "up"


def test_the_gc_backstop_of_an_unclosed_cluster_kills_its_children_without_an_exit_handler_failing() -> None:
    """An owner that never shut its cluster down (an exception, a forgotten close): the `weakref.finalize` backstop
    kills the children and removes the runtime dir; the supervisor then reports each exit. Before, each report tried
    to rewrite the manifest in the removed dir and logged `exit_handler_failed` with a traceback, once per child, and
    a restartable one (a copy worker) was restarted: a new process for a cluster nobody owns."""
    import structlog

    from tests.conftest import wait_for

    cluster = launch(_roles(), cluster_name=LT, runtime_dir=f"/tmp/kvlt-{os.getpid()}-gc")
    pids = {c.pid for c in cluster._children.values()}
    with structlog.testing.capture_logs() as logs:
        cluster._finalizer()  # what the garbage collector (or the interpreter's exit) runs for an unclosed cluster
        wait_for(lambda: sum(e["event"] in ("child_exited", "child_died") for e in logs) >= 3, timeout=60,
                 what="the supervisor's report of every child's exit")
    assert not os.path.exists(cluster.runtime_dir)
    assert [e["event"] for e in logs if e["log_level"] == "error"] == []  # no exit_handler_failed, no child_died
    assert {c.pid for c in cluster._children.values()} == pids  # nothing restarted
    cluster.shutdown()  # the supervisor and the janitor stop; nothing left (the autouse fixture checks)
