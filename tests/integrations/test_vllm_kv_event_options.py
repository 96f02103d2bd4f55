"""The vLLM connector's KV-event settings (`kv_connector_extra_config`: `kv_events`, `kv_events_interval_ms`,
`kv_events_tokens`), checked without vLLM: bad values are refused with the key named, and an engine that asks for
events from a shared tier (`tier_runtime_dir`) is refused, with the `kvproc up` flag to add, when that tier
publishes none. The engine end to end: `tests/integrations/vllm/test_vllm_kv_events.py`."""

from __future__ import annotations

import pytest

from kvproc.integrations.vllm.runtime import RuntimeOptions, check_shared_tier_events, kv_event_endpoints
from tests.conftest import kvproc_up


@pytest.mark.parametrize("extra, why", [
    ({"kv_events_tokens": True}, "need kv_events"),
    ({"kv_events_interval_ms": 10}, "need kv_events"),
    ({"kv_events_into_vllm": True}, "need kv_events"),
    ({"kv_events": True, "kv_events_interval_ms": 0}, "kv_events_interval_ms must be > 0"),
    ({"kv_events": True, "kv_events_interval_ms": 1e12}, "kv_events_interval_ms must be > 0"),
    ({"kv_events": True, "kv_events_interval_ms": "fast"}, "kv_events_interval_ms must be > 0"),
    ({"kv_events": True, "kv_events_interval_ms": 10, "tier_runtime_dir": "/x"}, "shared tier's setting"),
    ({"device_kv_events": True}, "unknown key"),  # kvproc caches nothing in the engine: no device-pool stream
])
def test_bad_kv_event_settings_are_refused_with_the_key_named(extra: dict, why: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=why):
        RuntimeOptions.from_extra(extra)


def test_good_settings_pass() -> None:
    o = RuntimeOptions.from_extra({"kv_events": True, "kv_events_interval_ms": 10, "kv_events_tokens": True,
                                   "kv_events_into_vllm": True})
    assert o.kv_events and o.kv_events_interval_ms == 10 and o.kv_events_tokens and o.kv_events_into_vllm
    assert not RuntimeOptions.from_extra({"kv_events": True}).kv_events_into_vllm  # opt-in


def test_a_shared_tier_without_events_is_refused_and_one_with_them_is_named() -> None:
    with kvproc_up("kvvev") as (rd, _):
        with pytest.raises(ValueError, match=r"publishes none: start it with `kvproc up --kv-events`"):
            check_shared_tier_events(rd, tokens=False)
        assert kv_event_endpoints(rd) == {}
    with kvproc_up("kvvev", "--kv-events") as (rd, _):
        check_shared_tier_events(rd, tokens=False)
        with pytest.raises(ValueError, match=r"--kv-events --kv-events-tokens"):
            check_shared_tier_events(rd, tokens=True)
        (tier,) = kv_event_endpoints(rd).values()
        assert tier["kv_events"].startswith("ipc://") and tier["kv_events_tokens"] == "0"
    with kvproc_up("kvvev", "--kv-events", "--kv-events-tokens") as (rd, _):
        check_shared_tier_events(rd, tokens=True)
