"""The demo writes its log to the temp dir unless given `--log` (for a person, who is told where it is); a test's
demo run writes it into the test's own tmp_path, so that no run leaves a `kvproc-demo-<pid>.log` behind."""

from __future__ import annotations

import types
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvproc.demo import single


@pytest.fixture(autouse=True)
def demo_log_in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(single, "tempfile", types.SimpleNamespace(gettempdir=lambda: str(tmp_path)))
    yield
