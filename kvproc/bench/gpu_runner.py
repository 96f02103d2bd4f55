"""How `kvproc bench gpu` runs its parts so that a first-ever GPU run is never wasted by one failure.

Every part (one round trip, one bandwidth measurement, one demo, one sanity check) runs isolated: an exception is
recorded with its traceback (printed, and in the JSON under `parts`) and the next part runs. The JSON is rewritten
after every part, so a run killed by an outer timeout still leaves what it measured. On a GPU each group of CUDA
parts runs in its own child process (`--group`), under its share of the time budget: a sticky CUDA error (an illegal
address poisons the process's context), a crash or a hang then costs that group only. The exit status is 0 only if
every part passed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

ROWS = ("sanity", "round_trip", "bandwidth", "demo")  # the result lists a part's rows go to


@dataclass(frozen=True)
class Part:
    """One isolated piece of the check: `fn` returns its rows (dicts; a row with "ok": False fails the part)."""

    section: str  # one of ROWS
    name: str
    fn: Callable[[], list[dict[str, Any]]]


@dataclass(frozen=True)
class Group:
    """Parts that share a process; `cuda`: needs a CUDA device (a child process of its own on a GPU). `cap_s`: the
    most its child may run (also bounded by what is left of the whole budget)."""

    name: str
    parts: Callable[[], list[Part]]
    cuda: bool
    cap_s: float
    skipped: str = ""  # what is printed as SKIPPED when there is no CUDA device


def new_result() -> dict[str, Any]:
    return {"parts": [], "skipped": [], **{k: [] for k in ROWS}}


class Recorder:
    """The result being built, written to `path` (if any) after every part."""

    def __init__(self, result: dict[str, Any], path: str | None) -> None:
        self.result, self.path = result, path

    def save(self) -> None:
        if self.path:
            tmp = f"{self.path}.tmp"
            with open(tmp, "w") as f:
                json.dump(self.result, f, indent=1, default=str)
            os.replace(tmp, self.path)

    def run_part(self, group: str, part: Part, show: Callable[[str, dict[str, Any]], str]) -> bool:
        t0 = time.perf_counter()
        record: dict[str, Any] = {"group": group, "section": part.section, "name": part.name}
        try:
            rows = part.fn()
            bad = [r for r in rows if not r.get("ok", True)]
            record["ok"] = not bad
            if bad:
                record["error"] = "; ".join(r.get("error", "a row did not pass") for r in bad)
        except Exception as e:  # noqa: BLE001 - the point: record it and go on to the next part
            rows = []
            record.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        record["seconds"] = round(time.perf_counter() - t0, 3)
        self.result[part.section] += rows
        self.result["parts"].append(record)
        for r in rows:
            print(f"  {show(part.section, r)}", flush=True)
        status = "ok" if record["ok"] else "FAILED"
        print(f"[{status}] {group} / {part.name} ({record['seconds']:.1f} s)", flush=True)
        if not record["ok"]:
            print(f"    {record['error']}", flush=True)
            for r in rows:
                if r.get("traceback"):
                    print(r["traceback"], end="", flush=True)
            if "traceback" in record:
                print(record["traceback"], end="", flush=True)
        self.save()
        return bool(record["ok"])

    def run_group(self, group: Group, show: Callable[[str, dict[str, Any]], str]) -> None:
        try:
            parts = group.parts()
        except Exception as e:  # noqa: BLE001 - even listing the parts may fail on a broken machine
            self.result["parts"].append({"group": group.name, "section": "", "name": f"{group.name} (its parts)",
                                         "ok": False, "error": f"{type(e).__name__}: {e}",
                                         "traceback": traceback.format_exc(), "seconds": 0.0})
            print(f"[FAILED] {group.name}: listing its parts: {e}\n{traceback.format_exc()}", end="", flush=True)
            self.save()
            return
        for part in parts:
            self.run_part(group.name, part, show)

    def run_child(self, group: Group, argv: list[str], timeout_s: float) -> None:
        """The group in a child process (`kvproc bench gpu --group NAME`); its JSON merged here, even a partial one
        (a crash or a timeout is recorded as a failed part of the group)."""
        print(f"--- {group.name}: child process, at most {timeout_s:.0f} s", flush=True)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "part.json")
            cmd = [sys.executable, "-m", "kvproc", "bench", "gpu", "--group", group.name, "--json", path, *argv]
            t0 = time.perf_counter()
            problem = ""
            try:
                rc = subprocess.run(cmd, check=False, timeout=timeout_s).returncode
                if rc not in (0, 1):  # 1: a part failed, and the child recorded it
                    problem = f"the child process exited with status {rc}"
            except subprocess.TimeoutExpired:
                problem = f"the child process ran past {timeout_s:.0f} s and was killed"
            child: dict[str, Any] = {}
            if os.path.exists(path):
                with open(path) as f:
                    child = json.load(f)
            elif not problem:
                problem = "the child process wrote no results"
        for key in ("parts", "skipped", *ROWS):
            self.result[key] += child.get(key, [])
        if problem:
            self.result["parts"].append({"group": group.name, "section": "", "name": f"{group.name} (child process)",
                                         "ok": False, "error": problem,
                                         "seconds": round(time.perf_counter() - t0, 3)})
            print(f"[FAILED] {group.name}: {problem}", flush=True)
        self.save()


def all_passed(result: dict[str, Any]) -> bool:
    return bool(result["parts"]) and all(p["ok"] for p in result["parts"])
