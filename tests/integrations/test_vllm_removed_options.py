"""Settings the vLLM connector no longer has (`kv_connector_extra_config`), checked without vLLM: a config that names
one is refused at start with what replaced it, never silently ignored (it would have changed how bytes move)."""

from __future__ import annotations

import pytest

from kvproc.integrations.vllm.runtime import RuntimeOptions


@pytest.mark.parametrize("extra, why", [
    ({"async_moves": True}, "async_moves was removed; use loads="),
    ({"path": "staging"}, r"\['path'\] removed: pages move in one copy each way"),
    ({"mover": "cma"}, r"\['mover'\] removed"),
    ({"staging_blocks": 32, "path": "direct"}, r"\['path', 'staging_blocks'\] removed"),
])
def test_a_removed_setting_is_refused_with_what_replaced_it(extra: dict, why: str) -> None:  # type: ignore[type-arg]
    with pytest.raises(ValueError, match=why):
        RuntimeOptions.from_extra(extra)


def test_the_settings_that_remain_pass() -> None:
    assert RuntimeOptions.from_extra({"loads": "async", "host_bytes": 1 << 20}).loads == "async"
