"""`kvproc bench replay --eviction`: the replay runs under every eviction policy. (`--vs-vllm` is tested in the vLLM
suite, `tests/integrations/vllm/test_vllm_replay.py`: it needs `.venv-vllm` whole, which `make test` builds while this
suite runs.)"""

import math
from pathlib import Path

import pytest

from kvproc.bench.replay import load_trace, replay
from kvproc.core.eviction import POLICIES

TINY = Path(__file__).parent.parent / "data" / "trace_tiny.jsonl"


@pytest.mark.parametrize("eviction", POLICIES)
def test_replay_under_every_policy_matches_the_hand_computed_ratios(eviction):
    r = replay(load_trace(TINY), page_tokens=512, device_tokens=math.inf, eviction=eviction)
    assert r.token_hit_ratio == pytest.approx(3072 / 5600)
    # the smallest pool (4 pages) with a host tier behind it: whatever the device evicts, the host serves
    r = replay(load_trace(TINY), page_tokens=512, device_tokens=1, host_tokens=math.inf, eviction=eviction)
    assert r.block_hit_ratio == pytest.approx(6 / 12)
