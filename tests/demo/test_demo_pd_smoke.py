"""`kvproc demo --pd` end to end on a tiny workload: a prefill and a decode engine process sharing a `kvproc up`
host tier, the router, and the JSON keys the P/D issue names."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kvproc.demo.single import main
from kvproc.ipc.segment import list_segments


def test_demo_pd_completes_every_handoff_and_matches_the_single_engine_run(tmp_path: Path) -> None:
    out = tmp_path / "pd.json"
    rc = main(["--pd", "--model", "hybrid", "--scale", "0.05", "--conversations", "2", "--turns", "2",
               "--concurrency", "2", "--no-progress", "--json", str(out)])
    data = json.loads(out.read_text())
    assert rc == 0, data.get("first_difference")
    assert set(data["runs"]) == {"kvproc", "pd", "pd_barrier"}
    assert data["handoffs_completed"] == 4 and data["handoffs_rejected"] == 0
    assert data["barrier"]["handoffs_completed"] == 4
    assert data["pd_outputs_identical"] is True
    assert all(r["turns_failed"] == 0 for r in data["runs"].values())
    # Only what this test started: the shared tier's cluster is named after this process (`pd<pid>x<n>`); another
    # run's segments on the same machine are none of this test's business.
    assert not [s for s in list_segments() if s.startswith(f"kvproc.pd{os.getpid()}x")]
