"""No child outlives a SIGKILLed launcher (issue 39, item 7; `kvproc/runtime/parent_death.py`).

A driver process (below) makes itself a child subreaper, so every process of the trees it starts -- the forkserver,
the host tier, the janitor that forks itself away from the launcher -- stays its descendant once orphaned: it sees
exactly what it started, nothing else on the machine. It then starts `kvproc up` again and again on one runtime dir
(so later starts also meet a dir a killed launcher left: the issue's orphan was started on a stale one) and SIGKILLs
the launcher at a random point: during start-up, or once it is up. In half the rounds the launchers' stderr is a pipe
the driver stops reading and fills just before the kill (a supervisor that stopped reading its child's output): any
write to it blocks, and whoever blocks holds structlog's and the stream's locks. After each kill every process the
round started must be gone within a generous deadline, with none of the round's shm names left.

Control (run for this item): the old death path -- `log.error("launcher_died")` through structlog, an orderly stop,
a 3 s grace, another log line, `os._exit` -- fails the stalled rounds: the host tier is still alive at the deadline,
its watcher thread blocked in the log call (the driver's report names the survivors). The same test passes with the
lock-free path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROUNDS = int(os.environ.get("KVPROC_ORPHAN_ROUNDS", "12"))  # raise it for a soak
DEADLINE_S = 15.0  # per round, for every process to be gone: generous, on a loaded 2-core machine

_DRIVER = textwrap.dedent(r'''
    import ctypes, json, os, random, signal, subprocess, sys, threading, time
    import psutil

    cluster, rd, rounds, seed, deadline_s = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(36, 1, 0, 0, 0) == 0, "PR_SET_CHILD_SUBREAPER"  # orphans of our trees are re-parented to us
    me = psutil.Process()
    rng = random.Random(seed)

    def ours_in_shm():
        return sorted(e for e in os.listdir("/dev/shm") if e.startswith(f"kvproc.{cluster}."))

    def reap():
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    def alive():
        reap()
        out = []
        for p in me.children(recursive=True):
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.NoSuchProcess:
                pass
        return out

    def describe(p):
        try:
            return f"{p.pid} {' '.join(p.cmdline())[:120]} threads={p.num_threads()}"
        except psutil.Error:
            return str(p.pid)

    report = []
    for i in range(rounds):
        phase = "startup" if i % 4 < 2 else "steady"
        stalled = i % 2 == 1
        r, w = os.pipe()
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvproc", "up", "--cluster", cluster, "--runtime-dir", rd, "--host-mib", "1"],
            stdout=subprocess.PIPE, stderr=w, stdin=subprocess.DEVNULL)
        lines = []
        if not stalled:
            os.close(w)
            w = -1
            drain = threading.Thread(target=lambda: lines.extend(os.fdopen(r, "rb", closefd=False).read().splitlines()),
                                     daemon=True)
            drain.start()
        t0 = time.monotonic()
        if phase == "startup":
            time.sleep(rng.uniform(0.0, 2.5))
        else:
            up = proc.stdout.readline()
            assert b"up; manifest" in up, f"round {i}: kvproc up did not come up: {up!r}"
            time.sleep(rng.uniform(0.0, 0.5))
        kill_after = time.monotonic() - t0
        if stalled:  # fill the pipe: from here on, every write to the launchers' stderr blocks
            # Through an open file description of our own: O_NONBLOCK on `w` would be the children's stderr's too.
            fill = os.open(f"/proc/self/fd/{w}", os.O_WRONLY | os.O_NONBLOCK)
            try:
                while True:
                    os.write(fill, b"x" * 65536)
            except BlockingIOError:
                pass
            os.close(fill)
        tree = [p.pid for p in alive()]
        os.kill(proc.pid, signal.SIGKILL)
        t_kill = time.monotonic()
        while alive() and time.monotonic() - t_kill < deadline_s:
            time.sleep(0.02)
        gone_s = time.monotonic() - t_kill
        survivors = [describe(p) for p in alive()]
        for p in alive():  # a failed round must not leak into the next one (or the machine)
            try:
                p.kill()
            except psutil.Error:
                pass
        if stalled:
            os.close(w)
        else:
            drain.join(5)
        os.close(r)
        proc.stdout.close()
        end = time.monotonic() + 5
        while alive() and time.monotonic() < end:
            time.sleep(0.02)
        report.append({"round": i, "phase": phase, "stalled": stalled, "kill_after_s": round(kill_after, 3),
                       "processes": len(tree), "gone_s": round(gone_s, 3), "survivors": survivors,
                       "shm_left": ours_in_shm(), "dir_left": os.path.exists(rd),
                       "launcher_died_notes": sum(b'"launcher_died"' in ln for ln in lines)})
    print(json.dumps(report), flush=True)
''')


def test_no_child_outlives_a_launcher_sigkilled_at_random_points(tmp_path: Path) -> None:
    cluster, runtime_dir = f"pd{os.getpid()}", str(tmp_path / "rt")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    seed = int.from_bytes(os.urandom(4), "little")
    out = subprocess.run([sys.executable, "-c", _DRIVER, cluster, runtime_dir, str(ROUNDS), str(seed), str(DEADLINE_S)],
                         env=env, capture_output=True, text=True, timeout=ROUNDS * 90)
    assert out.returncode == 0, f"driver failed (seed {seed}):\n{out.stderr[-3000:]}"
    rounds = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(rounds) == ROUNDS
    assert {(r["phase"], r["stalled"]) for r in rounds} >= {("startup", False), ("startup", True),
                                                            ("steady", False), ("steady", True)}
    for r in rounds:
        assert not r["survivors"], f"seed {seed}: processes outlived their launcher by {DEADLINE_S:g} s: {r}"
        assert not r["shm_left"], f"seed {seed}: shared memory left after the round: {r}"
    # Every steady-state round had a host tier, which left a line saying why it exited (unless the pipe was full).
    assert all(r["launcher_died_notes"] >= 1 for r in rounds if r["phase"] == "steady" and not r["stalled"]), rounds
    print("gone_s:", sorted(r["gone_s"] for r in rounds))
    # A dir left by a launcher killed before its janitor started is stale: the next start reclaims it, and so does
    # `kvproc down` (it removes a marked dir whose launcher is provably dead).
    if os.path.exists(runtime_dir):
        subprocess.run([sys.executable, "-m", "kvproc", "down", "--cluster", cluster, "--runtime-dir", runtime_dir],
                       env=env, capture_output=True, timeout=60)
    assert not os.path.exists(runtime_dir)
