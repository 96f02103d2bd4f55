"""`kvproc bench replay --vs-vllm`: run vLLM's KV manager on the same trace in its own venv, same run, and read its
numbers (`vllm_replay_child.py`). vLLM has no blake2b: kvproc's blake2b-128 and sha256-128 are compared with vLLM's
sha256 (both collision-resistant), xxh3-128 with vLLM's xxhash."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from kvproc.core.hashing import HashAlgorithm

VLLM_HASH = {HashAlgorithm.BLAKE2B_128: "sha256", HashAlgorithm.SHA256_128: "sha256", HashAlgorithm.XXH3_128: "xxhash"}


def run_vllm(python: Path, trace: Path, limit: int | None, algorithm: HashAlgorithm) -> dict[str, Any]:
    if not python.exists():
        raise SystemExit(f"kvproc bench replay --vs-vllm: {python} not found (make venv-vllm)")
    child = Path(__file__).with_name("vllm_replay_child.py")
    # The child imports kvproc's trace reader from this source tree, not from whatever kvproc that venv installed
    # (none yet while `make test` is still building it).
    source_root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [source_root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([str(python), str(child), str(trace), str(limit or 0), VLLM_HASH[algorithm]],
                          capture_output=True, text=True, check=False, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        raise SystemExit(f"vLLM replay failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result
