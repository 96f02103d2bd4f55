"""`kvproc bench gpu --quick`: its CPU parts run (every model round-trips bit-exact through memmove, torch and cma, the
bandwidth table has its rows), and without CUDA it names the parts it skipped. No timing assertions."""

import json

import torch

from kvproc.bench import gpu_check
from kvproc.engine.models import MODEL_NAMES
from kvproc.workers.movers import MemmoveMover
from kvproc.workers.torch_mover import TorchRowsMover


def test_gpu_check_runs_its_cpu_parts_and_names_what_it_skipped(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--quick", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
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
