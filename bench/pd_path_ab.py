"""P/D through kvproc on the direct path against the staging path (issue 34): the consumer's time per hand-off.

A producer and a consumer vLLM engine (in-process, one after the other: vLLM keeps one KV connector per process) on
one `kvproc up` tier, a tiny random Llama made wide enough that a page is 256 KiB (8 layers, 4 KV heads of 32,
float32). The producer prefills N prompts (max_tokens=1); the consumer continues each hand-off for one token (its
time: the hand-off's full-hit query, its load into vLLM's blocks, the anchor's forward). Each arm runs in its own
process, the arms alternate `--rounds` times. Printed: the consumer's per-request wall time (median, mean; the first
two requests of each run are warm-up and left out), the producer's, and whether both arms' tokens are equal.

    .venv-vllm/bin/python bench/pd_path_ab.py [--prompts 12] [--tokens 2000] [--rounds 2]

`PD_AB_COUNTERS=1` also prints each run's per-request consumer times and the consumer connector's counters.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ARMS = ("direct", "staging")


def _engine(model: str, tier: str | None, role: str, path: str) -> Any:
    from vllm import LLM

    kw: dict[str, Any] = {}
    if tier is not None:
        kw["kv_transfer_config"] = {
            "kv_connector": "KvprocConnector", "kv_connector_module_path": "kvproc.integrations.vllm.connector",
            "kv_role": role, "kv_connector_extra_config": {"tier_runtime_dir": tier, "path": path, "host_bytes": 400 << 20}}
    return LLM(model=model, skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=4096,
               block_size=32, num_gpu_blocks_override=256, max_num_seqs=2, enable_prefix_caching=True, seed=0,
               async_scheduling=False, **kw)


def _gen(llm: Any, prompt: list[int], params: dict[str, Any] | None = None) -> tuple[Any, float]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True,
                        extra_args={"kv_transfer_params": params} if params else None)
    t0 = time.perf_counter()
    (out,) = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)
    return out, (time.perf_counter() - t0) * 1e3


def child(arm: str, model: str, tier: str, prompts: list[list[int]]) -> dict[str, Any]:
    from kvproc.integrations.vllm.connector import HANDOFF_KEY

    llm = _engine(model, tier, "kv_producer", arm)
    handed = [_gen(llm, p) for p in prompts]
    llm.llm_engine.engine_core.shutdown()
    del llm
    envs = [o.kv_transfer_params[HANDOFF_KEY] for o, _ in handed]
    llm = _engine(model, tier, "kv_consumer", arm)
    got = [_gen(llm, p + [e["anchor_token_id"]], {HANDOFF_KEY: e}) for p, e in zip(prompts, envs)]
    cached = [o.num_cached_tokens for o, _ in got]
    from kvproc.integrations.vllm.runtime import live_runtimes

    (rt,) = live_runtimes()
    counters = dict(rt.counters)
    llm.llm_engine.engine_core.shutdown()
    return {"arm": arm, "producer_ms": [ms for _, ms in handed], "consumer_ms": [ms for _, ms in got],
            "tokens": [list(o.outputs[0].token_ids) for o, _ in got], "cached": cached,
            "committed": [e["committed_len"] for e in envs], "counters": counters}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", default="")
    ap.add_argument("--model", default="")
    ap.add_argument("--tier", default="")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(3, 500) for _ in range(a.tokens - i)] for i in range(a.prompts)]
    if a.child:
        print("RESULT " + json.dumps(child(a.child, a.model, a.tier, prompts)), flush=True)
        return
    from kvproc.integrations.vllm.tiny_llama import build_tiny_llama

    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_KVCACHE_SPACE="1",
               VLLM_LOGGING_LEVEL="ERROR")
    with tempfile.TemporaryDirectory(prefix="pd-ab-") as d:
        model = str(build_tiny_llama(Path(d) / "m", layers=8, hidden=256, heads=8, kv_heads=4))
        runs: list[dict[str, Any]] = []
        for r in range(a.rounds):
            for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
                rd = f"{d}/tier-{arm}-{r}"
                up = subprocess.Popen([sys.executable, "-m", "kvproc", "up", "--cluster", f"pdab{os.getpid()}{r}{arm[0]}",
                                       "--runtime-dir", rd, "--host-mib", "512"], stdout=subprocess.PIPE, text=True)
                try:
                    assert up.stdout is not None and "up; manifest" in up.stdout.readline()
                    out = subprocess.run([sys.executable, __file__, "--child", arm, "--model", model, "--tier", rd,
                                          "--prompts", str(a.prompts), "--tokens", str(a.tokens), "--seed",
                                          str(a.seed)], env=env, capture_output=True, text=True)
                    if out.returncode:
                        sys.exit(f"{arm} run failed:\n{out.stderr[-3000:]}")
                finally:
                    subprocess.run([sys.executable, "-m", "kvproc", "down", "--runtime-dir", rd, "--timeout", "10"],
                                   check=False, capture_output=True)
                    up.wait(10)
                runs.append(json.loads(next(ln for ln in out.stdout.splitlines() if ln.startswith("RESULT "))[7:]))
    page_kib = 8 * 4 * 32 * 64 * 4 // 1024
    print(f"{a.prompts} hand-offs of {a.tokens - a.prompts + 1}-{a.tokens} tokens, {page_kib} KiB a page, "
          f"{a.rounds} rounds, load {os.getloadavg()[0]:.1f}")
    for arm in ARMS:
        mine = [x for x in runs if x["arm"] == arm]
        cons = [ms for x in mine for ms in x["consumer_ms"][2:]]
        prod = [ms for x in mine for ms in x["producer_ms"][2:]]
        full = all(c == n for x in mine for c, n in zip(x["cached"], x["committed"]))
        per_run = [round(statistics.median(x["consumer_ms"][2:]), 1) for x in mine]
        print(f"{arm:8s} consumer ms median {statistics.median(cons):7.2f} mean {statistics.mean(cons):7.2f} "
              f"(run medians {per_run}) | producer ms median {statistics.median(prod):7.2f} | every hand-off "
              f"loaded: {full}")
    same = len({json.dumps(x["tokens"]) for x in runs}) == 1
    print(f"tokens equal across arms and rounds: {same}")
    if os.environ.get("PD_AB_COUNTERS"):
        for x in runs:
            print(x["arm"], x["consumer_ms"], x["counters"])


if __name__ == "__main__":
    main()
