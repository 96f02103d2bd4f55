"""The control path's fast forms end to end: `kvproc demo --runs kvproc` with them on (the defaults) against off.

    .venv/bin/python bench/control_path_ab.py [PAIRS] [-- demo options]

`lean`: `StoreConfig(resolve_threads=0, speculative_loads=False, verified_loads=False)`: every resolve on the store's
loop, queried before it loads. Each run is its own process; the arms' order alternates per pair. Prints each run's
TTFT p50 / p99, output tok/s, wall and host-hit tokens, then the medians. Why: a micro-benchmark gain that no
end-to-end figure shows is a cost (bench/RESULTS.md, "Control path", the end-to-end A/B).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ARMS: dict[str, dict[str, Any]] = {
    "default": {},
    "lean": {"resolve_threads": 0, "speculative_loads": False, "verified_loads": False},
}


def _child(arm: str, argv: list[str]) -> int:
    import kvproc.demo.single as demo
    from kvproc.store.types import StoreConfig

    options = ARMS[arm]

    def config(**kw: Any) -> StoreConfig:  # the demo's own settings win over the arm's
        return StoreConfig(**{**options, **kw})

    demo.StoreConfig = config  # type: ignore[misc,assignment]
    return demo.main(argv)


def main(argv: list[str]) -> int:
    pairs = int(argv[0]) if argv and argv[0] != "--" else 3
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    rows: dict[str, list[tuple[float, ...]]] = {a: [] for a in ARMS}
    with tempfile.TemporaryDirectory(prefix="kvproc-ab-") as work:
        for i in range(pairs):
            for arm in (list(ARMS) if i % 2 == 0 else list(ARMS)[::-1]):
                out = Path(work) / f"{arm}-{i}.json"
                subprocess.run([sys.executable, __file__, "--arm", arm, "--runs", "kvproc", "--no-progress",
                                "--json", str(out), *extra], check=True, stdout=subprocess.DEVNULL)
                r = json.loads(out.read_text())["runs"]["kvproc"]
                rows[arm].append((r["ttft_p50_ms"], r["ttft_p99_ms"], r["output_tok_s"], r["wall_s"],
                                  r["host_hit_tokens"]))
                print(arm, i, " ".join(f"{x:.1f}" for x in rows[arm][-1]), flush=True)
    print("arm: median TTFT p50 ms, p99 ms, out tok/s, wall s, host-hit tokens")
    for arm, rs in rows.items():
        print(arm, " ".join(f"{statistics.median(r[k] for r in rs):.1f}" for k in range(5)))
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--arm":
        sys.exit(_child(sys.argv[2], sys.argv[3:]))
    sys.exit(main(sys.argv[1:]))
