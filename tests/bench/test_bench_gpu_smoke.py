"""`kvproc bench gpu --quick`: its CPU parts run (every model round-trips bit-exact through memmove, torch and cma, the
bandwidth table has its rows), and without CUDA it names the parts it skipped. No timing assertions."""

import json

import torch

from kvproc.bench import gpu_check, gpu_runner
from kvproc.engine.models import MODEL_NAMES
from kvproc.workers.movers import MemmoveMover
from kvproc.workers.torch_mover import TorchRowsMover


def test_gpu_check_runs_its_cpu_parts_and_names_what_it_skipped(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--quick", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["parts"] and all(p["ok"] for p in r["parts"])
    cpu_trips = {(x["model"], x["mover"]) for x in r["round_trip"] if x["mover"] != "cuda"}
    assert cpu_trips == {(m, mv) for m in MODEL_NAMES for mv in ("memmove", "torch", "cma")}
    assert all(x["ok"] for x in r["round_trip"])
    assert {(x["op"], x["layout"]) for x in r["bandwidth"] if x["mover"] == "memmove"} == \
        {(op, lay) for op in ("save", "load") for lay in ("contiguous", "scattered")}
    assert all(x["gbps"] > 0 and x["ratio"] > 0 for x in r["bandwidth"])
    printed = capsys.readouterr().out
    assert "SKIPPED: demo on a GPU" in printed
    if not torch.cuda.is_available():
        assert r["cuda"] is False and "SKIPPED: round trip through the cuda mover: no CUDA device" in printed


def test_gpu_check_fails_when_a_round_trip_loses_bytes(monkeypatch):
    """Control: a mover that moves nothing makes the round trip a mismatch and the script's status 1."""
    monkeypatch.setattr(MemmoveMover, "rows", lambda self, *a: len(a[2]) * a[6])
    assert gpu_check.main(["--quick"]) == 1


def test_gpu_check_fails_when_the_torch_movers_batches_move_nothing(monkeypatch):
    """Control for the torch part (the GPU path's logic on CPU): its move a no-op, the memmove part intact."""
    monkeypatch.setattr(TorchRowsMover, "_move", lambda self, *a: None)
    assert gpu_check.main(["--quick"]) == 1


def test_a_part_that_raises_is_recorded_with_its_traceback_and_the_next_parts_still_run(tmp_path, capsys, monkeypatch):
    """The isolation a first GPU run relies on: a part raising first in its group (a test-only failing part) is
    recorded (error and traceback, printed and in the JSON), every part after it still runs and passes, and the exit
    status is 1."""
    listed = gpu_check.cpu_parts
    monkeypatch.setattr(gpu_check, "cpu_parts", lambda z: [
        gpu_runner.Part("round_trip", "test_only_failing_part", _raise_test_only), *listed(z)])
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--quick", "--json", str(out)]) == 1
    r = json.loads(out.read_text())
    first, *rest = r["parts"]
    assert first["name"] == "test_only_failing_part" and not first["ok"]
    assert first["error"] == "RuntimeError: test-only failure in a part"
    assert "Traceback" in first["traceback"] and "_raise_test_only" in first["traceback"]
    assert [p["name"] for p in rest] == [f"{m} cpu movers" for m in MODEL_NAMES] + ["64KiB memmove"]
    assert all(p["ok"] for p in rest)
    assert {x["model"] for x in r["round_trip"]} == set(MODEL_NAMES) and r["bandwidth"]
    printed = capsys.readouterr().out
    assert "[FAILED] cpu / test_only_failing_part" in printed and "_raise_test_only" in printed
    assert "FAILED: cpu / test_only_failing_part: RuntimeError: test-only failure in a part" in printed
    assert f"{len(rest)} of {len(rest) + 1} parts passed" in printed


def _raise_test_only() -> list:
    raise RuntimeError("test-only failure in a part")


def test_a_group_runs_in_a_child_process_and_a_child_past_its_time_is_recorded(tmp_path):
    """How a GPU run isolates each CUDA group (here the CPU group, the only one this machine has): a real child
    process (`kvproc bench gpu --group cpu`), its parts merged into this run's result; a child killed at its timeout
    is a failed part of its group, and the run goes on."""
    cpu = next(g for g in gpu_check.groups(gpu_check.Sizes.of(True), 0.0) if g.name == "cpu")
    rec = gpu_runner.Recorder(gpu_runner.new_result(), str(tmp_path / "r.json"))
    rec.run_child(cpu, ["--quick"], 120)
    names = [p["name"] for p in rec.result["parts"]]
    assert names == [f"{m} cpu movers" for m in MODEL_NAMES] + ["64KiB memmove"]
    assert all(p["ok"] for p in rec.result["parts"]) and len(rec.result["round_trip"]) == 3 * len(MODEL_NAMES)
    rec.run_child(cpu, ["--quick"], 0.01)
    last = rec.result["parts"][-1]
    assert last["name"] == "cpu (child process)" and not last["ok"] and "was killed" in last["error"]
    assert not gpu_runner.all_passed(rec.result)
    assert json.loads((tmp_path / "r.json").read_text())["parts"][-1] == last  # saved as it went
