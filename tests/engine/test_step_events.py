"""The reference engine's step fence (`kvproc/engine/step_events.py`): on the CPU the models record nothing and the
store gets no fence (no call, no handle); `step_fence_of` hands each rank its own model's latest event; on a GPU
(skipped without CUDA: never run) every step records the next event of a small interprocess ring, whose handle the
store puts into its saves."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvproc.engine.models import MODEL_NAMES
from kvproc.engine.step_events import RING, step_fence_of
from kvproc.engine.topology import PoolSizes, make_store
from tests.engine.conftest import fresh, make, run, tokens

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="no CUDA device (torch.cuda.is_available() is False): the step "
                                                 "events have never been recorded")
SIZES = PoolSizes(device_blocks=32, live_slots=2, staging_slots=4, host_bytes=4 << 20, page_tokens=8)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_on_the_cpu_a_model_records_no_step_event_and_gives_no_fence(name: str) -> None:
    model = make(name)
    toks = tokens(model, 16)
    run(model, toks, [0, 16], list(range(8)), fresh(model, 0))
    assert model.step_events is None and step_fence_of([model]) is None


@pytest.mark.timeout(60)
def test_the_cpu_process_topology_attaches_without_a_fence() -> None:
    with make_store("kvproc", "dense", SIZES, processes=True) as topo:
        assert topo.store.step_fence is None


class _StepEventsStub:
    """A model's step events as `step_fence_of` reads them (test only): just the latest handle."""

    def __init__(self, latest: bytes | None) -> None:
        self.latest = latest


class _RankModelStub:
    def __init__(self, events: Any) -> None:
        self.step_events = events


def test_the_fence_gives_each_rank_its_own_models_latest_event() -> None:
    ranks = [_RankModelStub(_StepEventsStub(b"\x01" * 64)), _RankModelStub(_StepEventsStub(None))]
    fence = step_fence_of(ranks)  # type: ignore[arg-type]
    assert fence is not None and fence(0) == b"\x01" * 64 and fence(1) is None
    ranks[1].step_events.latest = b"\x02" * 64  # read at each call: the latest step's
    assert fence(1) == b"\x02" * 64


@needs_cuda
@pytest.mark.parametrize("name", MODEL_NAMES)
def test_on_a_gpu_each_step_records_the_next_event_of_the_ring(name: str) -> None:
    """NEVER RUN."""
    model = make(name, device="cuda")
    assert model.step_events is not None and model.step_events.latest is None
    toks = tokens(model, 8 * (RING + 1))
    handles = []
    sl = fresh(model, 0)
    for i in range(RING + 1):
        run(model, toks, [8 * i, 8 * (i + 1)], list(range(RING + 1)), sl)
        handles.append(model.step_events.latest)
    assert all(isinstance(h, bytes) and len(h) == 64 for h in handles)
    assert len(set(handles[:RING])) == RING and handles[RING] == handles[0]  # a ring: the first event again
    fence = step_fence_of([model])
    assert fence is not None and fence(0) == handles[-1]
