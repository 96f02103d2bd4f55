"""`device=` for the reference models and `kvproc demo --device`: on CPU nothing moves and a CUDA request without
CUDA is a clear error; on a GPU (skipped without CUDA: never run) the models and the demo run there."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvproc.engine.models import MODEL_NAMES, build_model
from tests.engine.conftest import fresh, make, run, tokens

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device (torch.cuda.is_available() is False): the GPU "
                                                 "models have never run")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_an_explicit_cpu_device_is_the_default_model(name: str) -> None:
    a, b = make(name), make(name, device="cpu")
    assert a.model_id == b.model_id and a.device == b.device == torch.device("cpu")
    assert all(x.tensor.device.type == "cpu" for _, x in b.arenas(0))
    toks = tokens(a, 40)
    assert torch.equal(run(a, toks, [0, 40], list(range(8)), fresh(a, 0)),
                       run(b, toks, [0, 40], list(range(8)), fresh(b, 0)))


@pytest.mark.skipif(CUDA, reason="the CPU-only refusal")
def test_asking_for_cuda_without_it_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="needs a CUDA device.*is_available"):
        build_model("dense", num_blocks=4, num_slots=2, device="cuda")
    with pytest.raises(ValueError, match="cpu or cuda"):
        build_model("dense", num_blocks=4, num_slots=2, device="meta")


@pytest.mark.skipif(CUDA, reason="the CPU-only refusal")
def test_the_demo_refuses_device_cuda_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    from kvproc.demo.single import main

    assert main(["--device", "cuda", "--scale", "0.05", "--no-progress"]) == 2
    assert "--device cuda needs a CUDA device" in capsys.readouterr().err


@needs_cuda
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_a_model_on_the_gpu_keeps_its_weights_and_picks_the_cpu_models_tokens(name: str) -> None:
    """NEVER RUN. Same seeded weights (the digest is taken on the CPU), arenas on the GPU, and the same greedy
    token at each prefix length as the CPU model (the tiny models' logits have clear margins)."""
    cpu, gpu = make(name), make(name, device="cuda")
    assert cpu.model_id == gpu.model_id
    assert all(a.tensor.is_cuda for _, a in gpu.arenas(0))
    toks = tokens(cpu, 40)
    for n in (8, 24, 40):
        want = run(cpu, toks, [0, n], list(range(8)), fresh(cpu, 0)).argmax()
        got = run(gpu, toks, [0, n], list(range(8)), fresh(gpu, 0)).argmax()
        assert int(got) == int(want), n


@needs_cuda
def test_the_demo_runs_on_the_gpu_with_identical_outputs(tmp_path: Path) -> None:
    """NEVER RUN. `kvproc demo --device cuda`: three runs, the copy workers opening the arenas by CUDA IPC."""
    import json

    from kvproc.demo.single import main

    out = tmp_path / "demo.json"
    assert main(["--device", "cuda", "--model", "dense", "--scale", "0.05", "--conversations", "4", "--turns", "2",
                 "--concurrency", "2", "--no-progress", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["outputs_identical"] is True
    assert all(r["turns_failed"] == 0 for r in data["runs"].values())
