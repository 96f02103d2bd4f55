"""`kvproc bench vllm`: vLLM alone vs vLLM + kvproc vs vLLM + vLLM's example disk connector, one chat workload.

Run it in an environment with vLLM (`make venv-vllm`: `.venv-vllm/bin/python -m kvproc bench vllm`). A random model
(8 layers, hidden 512 by default: prefill dominates on a CPU) of one KV kind (`--kind`: Llama's full attention by
default; a sliding-window Mistral, a hybrid sliding + full Gemma 3, an MLA DeepSeek-V2, a hybrid Gated-DeltaNet +
attention Qwen3-Next) is built in a temporary directory; each arm runs in its own process (vLLM keeps one KV connector
per process), on the same workload:

- `conversations` chats, a shared system prompt, a first user turn, then `new_per_turn` more user tokens per turn;
- `concurrency` clients, each owning some conversations and returning to the next of its own after each turn;
- vLLM's KV cache holds `vllm_blocks` blocks: less than all conversations, so evicted prefixes are recomputed by
  vLLM alone and restored by the connector arms;
- `one_shots` (default none) one-turn chats beside them, each client serving one between its conversations' turns
  while it has any left: they fill the host tier (sized by `host_mib`) with prompts nobody asks for again, the
  pressure under which the retention hint (`vllm_kvproc_hint`) is measured.

Per arm: TTFT p50/p99 (submit -> first token, the engine stepped by this process), output tokens/s over the run,
prompt tokens from vLLM's cache / from the connector / computed (vLLM's own counters), and for the kvproc arm the time
inside the connector's methods as a fraction of the engine's step time. Greedy decoding: `outputs_identical` compares
every turn's tokens across the arms.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ARMS = ("vllm", "vllm_kvproc", "vllm_disk")
# On request (--arms): every hit's load asynchronous (`loads="async"`: the request held back a step, for an A/B of
# "auto", which is synchronous for one KV cache group).
# And the serving layer's retention hint (docs/vllm.md, "Retention hint"): each turn of a conversation with a turn
# still to come carries `kvproc_retain_s` (the workload knows, as a chat application knows a session is open); the
# last turn and the one-shot chats carry none.
EXTRA_ARMS = ("vllm_kvproc_async", "vllm_kvproc_hint")
_KVPROC_ARMS = ("vllm_kvproc", "vllm_kvproc_async", "vllm_kvproc_hint")


# --kind -> (builder in `tiny_models`, its arguments beside the size, the engine's dtype and block size, vocabulary).
# Windows of 512 tokens: well inside the workload's 2-3k-token prompts, so a hit restores a window, not everything.
# Qwen3-Next: vLLM sizes its block to hold a GDN state page; kvproc pages are a power of two, so 512.
KINDS: dict[str, tuple[str, dict[str, Any], str, int, int]] = {
    "llama": ("", {}, "float32", 32, 4096),
    "mistral_swa": ("build_tiny_mistral_swa", {"sliding_window": 512}, "float32", 32, 512),
    "gemma3": ("build_tiny_gemma3", {"sliding_window": 512}, "float32", 32, 512),
    "mla": ("build_tiny_deepseek_mla", {}, "bfloat16", 32, 512),
    "qwen3_next": ("build_tiny_qwen3_next", {}, "bfloat16", 512, 512),
}


def build_model(out: Path, layers: int, hidden: int, seed: int = 1234, kind: str = "llama") -> Path:
    """The bench's model: head size 64 (one vLLM's CPU attention takes), half as many KV heads; Llama with a 4,096
    vocabulary, the other kinds `tiny_models`' (512)."""
    heads = hidden // 64
    if kind == "llama":
        from kvproc.integrations.vllm.tiny_llama import build_tiny_llama

        return build_tiny_llama(out, layers=layers, hidden=hidden, heads=heads, kv_heads=max(1, heads // 2),
                                seed=seed, max_positions=8192, vocab=4096, dtype=None)
    from kvproc.integrations.vllm import tiny_models

    builder, extra, *_ = KINDS[kind]
    size: dict[str, Any] = {"layers": layers, "hidden": hidden, "heads": heads}
    if kind != "mla":
        size["kv_heads"] = max(1, heads // 2)
    return getattr(tiny_models, builder)(out, **size, **extra, seed=seed, max_positions=8192, tokenizer=False)


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


class _Timer:
    """Seconds spent inside wrapped methods (the connector's), and inside the engine's step."""

    def __init__(self) -> None:
        self.connector_s = 0.0
        self.by_method: dict[str, float] = {}
        self.step_s = 0.0
        self.steps = 0

    def wrap_connector(self, cls: Any, names: tuple[str, ...]) -> None:
        for name in names:
            orig = getattr(cls, name)

            @functools.wraps(orig)
            def timed(*a: Any, __orig: Any = orig, __name: str = name, **kw: Any) -> Any:
                t = time.perf_counter()
                try:
                    return __orig(*a, **kw)
                finally:
                    dt = time.perf_counter() - t
                    self.connector_s += dt
                    self.by_method[__name] = self.by_method.get(__name, 0.0) + dt

            setattr(cls, name, timed)

    def wrap_step(self, cls: Any) -> None:
        orig = cls.step

        @functools.wraps(orig)
        def timed(*a: Any, **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                self.step_s += time.perf_counter() - t
                self.steps += 1

        cls.step = timed


_CONNECTOR_METHODS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
                      "update_connector_output", "request_finished", "handle_preemptions", "start_load_kv",
                      "wait_for_save", "get_finished", "get_block_ids_with_load_errors")


def run_arm(arm: str, model: Path, a: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """One arm, in this process: serve the workload, return its figures and every turn's tokens."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.core import EngineCore

    timer = _Timer()
    kw: dict[str, Any] = {}
    if arm in _KVPROC_ARMS:
        from kvproc.integrations.vllm.connector import KvprocConnector

        timer.wrap_connector(KvprocConnector, _CONNECTOR_METHODS)
        kw["kv_transfer_config"] = {"kv_connector": "KvprocConnector", "kv_role": "kv_both",
                                    "kv_connector_module_path": "kvproc.integrations.vllm.connector",
                                    "kv_connector_extra_config": {
                                        "host_bytes": a.host_mib << 20,
                                        **({"loads": "async"} if arm == "vllm_kvproc_async" else {})}}
    elif arm == "vllm_disk":
        kw["kv_transfer_config"] = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                    "kv_connector_extra_config": {"shared_storage_path": str(workdir / "disk")}}
    timer.wrap_step(EngineCore)
    _, _, dtype, block, vocab = KINDS[a.kind]
    max_len = a.system + a.first_input + (a.turns - 1) * (a.new_per_turn + a.output) + a.output + 64
    max_len = -(-max_len // block) * block
    blocks = a.vllm_blocks * 32 // block  # --vllm-blocks counts 32-token blocks whatever the kind's block
    # at least one longest request, in every KV cache group that keeps its blocks (one pool for all groups)
    least = (max_len // block + 2) * {"gemma3": 2, "qwen3_next": 2}.get(a.kind, 1)
    llm = LLM(model=str(model), skip_tokenizer_init=True, dtype=dtype, enforce_eager=True,
              max_model_len=max_len, block_size=block, num_gpu_blocks_override=max(blocks, least),
              max_num_seqs=a.concurrency, enable_prefix_caching=True, disable_log_stats=False,
              async_scheduling=False, seed=0, **kw)
    engine = llm.llm_engine
    sp = SamplingParams(max_tokens=a.output, temperature=0.0, ignore_eos=True)
    hinted = SamplingParams(max_tokens=a.output, temperature=0.0, ignore_eos=True,
                            extra_args={"kv_transfer_params": {"kvproc_retain_s": a.retain_s}})
    rng = random.Random(a.seed)
    top = vocab - 96  # token ids 3 .. top (the models' special ids are below 3)
    system = [rng.randrange(3, top) for _ in range(a.system)]
    n_convs = a.conversations + a.one_shots  # the one-shot chats after the conversations, one turn each
    convs = [system + [rng.randrange(3, top) for _ in range(a.first_input)] for _ in range(n_convs)]
    turns_of = [a.turns] * a.conversations + [1] * a.one_shots
    turn_of = [0] * n_convs
    owned = [[c for c in range(a.conversations) if c % a.concurrency == i] for i in range(a.concurrency)]
    shots = [[c for c in range(a.conversations, n_convs) if c % a.concurrency == i] for i in range(a.concurrency)]
    cursor = [0] * a.concurrency
    shot_next = [False] * a.concurrency  # a client alternates: a conversation's turn, then a one-shot chat
    ttft: list[float] = []
    ttft_by_turn: dict[int, list[float]] = {}
    outputs: dict[str, list[int]] = {}
    inflight: dict[str, tuple[int, int, float, float | None]] = {}  # req -> (client, conv, submitted, first)
    seq = 0
    m0 = engine_metrics(llm)

    def add(client: int, c: int) -> None:
        nonlocal seq
        rid = f"c{c}t{turn_of[c]}-{seq}"
        seq += 1
        comes_back = turn_of[c] + 1 < turns_of[c]
        engine.add_request(rid, TokensPrompt(prompt_token_ids=list(convs[c])),
                           hinted if comes_back and arm == "vllm_kvproc_hint" else sp)
        inflight[rid] = (client, c, time.perf_counter(), None)

    def submit(client: int) -> None:
        shot_next[client] = not shot_next[client]
        if shot_next[client] and shots[client]:
            add(client, shots[client].pop(0))
            return
        mine = owned[client]
        for _ in range(len(mine)):
            c = mine[cursor[client] % len(mine)]
            cursor[client] += 1
            if turn_of[c] < a.turns:
                add(client, c)
                return
        if shots[client]:  # its conversations are done: the rest of its one-shot chats
            add(client, shots[client].pop(0))

    t0 = time.perf_counter()
    for client in range(a.concurrency):
        submit(client)
    out_tokens = 0
    while inflight:
        for ro in engine.step():
            client, c, sub, first = inflight[ro.request_id]
            now = time.perf_counter()
            if first is None and ro.outputs and ro.outputs[0].token_ids:
                inflight[ro.request_id] = (client, c, sub, now)
                ttft.append(now - sub)
                ttft_by_turn.setdefault(turn_of[c], []).append(now - sub)
            if ro.finished:
                del inflight[ro.request_id]
                toks = list(ro.outputs[0].token_ids)
                out_tokens += len(toks)
                outputs[f"c{c}t{turn_of[c]}"] = toks
                turn_rng = random.Random(a.seed * 1000003 + c * 101 + turn_of[c])
                convs[c] = convs[c] + toks + [turn_rng.randrange(3, top) for _ in range(a.new_per_turn)]
                turn_of[c] += 1
                submit(client)
    wall = time.perf_counter() - t0
    m1 = engine_metrics(llm)
    d = {k: m1.get(k, 0) - m0.get(k, 0) for k in m1}
    prompt = int(d.get("vllm:prompt_tokens", 0) or d.get("vllm:prefix_cache_queries", 0))
    local = int(d.get("vllm:prefix_cache_hits", 0))
    external = int(d.get("vllm:external_prefix_cache_hits", 0))
    res: dict[str, Any] = {
        "ttft_p50_ms": 1000 * _pct(ttft, 0.5), "ttft_p99_ms": 1000 * _pct(ttft, 0.99),
        "output_tok_s": out_tokens / wall, "wall_s": wall, "turns": len(outputs),
        "prompt_tokens": prompt, "from_vllm_cache": local, "from_connector": external,
        "computed": max(0, prompt - local - external),
        "ttft_ms_by_turn": {t: 1000 * statistics.median(v) for t, v in sorted(ttft_by_turn.items())},
        # the turns a cache can serve: a conversation's second and later ones (what the hint is for)
        "ttft_later_turns_p50_ms": 1000 * _pct([x for t, v in ttft_by_turn.items() if t > 0 for x in v], 0.5),
        "outputs": outputs,
    }
    if arm in _KVPROC_ARMS:
        res["connector_s"] = timer.connector_s
        res["step_s"] = timer.step_s
        res["connector_share_of_step"] = timer.connector_s / timer.step_s if timer.step_s else 0.0
        res["connector_s_by_method"] = timer.by_method
        res["steps"] = timer.steps
        from kvproc.integrations.vllm.runtime import live_runtimes

        rt = live_runtimes()[0]
        res["kvproc_counters"] = dict(rt.counters)
        res["mover_busy_s"] = rt.moves.busy_s if rt.moves is not None else 0.0  # off vLLM's thread
    llm.llm_engine.engine_core.shutdown()
    return res


def engine_metrics(llm: Any) -> dict[str, float]:
    """vLLM's metrics of an `LLM` (`get_metrics()`), summed by name over their labels."""
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        v = getattr(m, "value", None)
        if isinstance(v, (int, float)):
            out[m.name] = out.get(m.name, 0) + v
    return out


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvproc bench vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("--kind", default="llama", choices=sorted(KINDS),
                   help="the model's KV kind (llama: full attention; the others need no --arms vllm_disk)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--turns", type=int, default=4)
    # Sized so that prefill dominates (the workload): on a CPU a decode step costs ~60 ms whatever it holds,
    # so with 256-token turns and 32 tokens out the decode steps were ~80% of vLLM alone's wall time. vLLM's cache
    # holds the 4 running conversations at their longest (4 x 92 blocks), not the 12 (bench/RESULTS.md, "vLLM
    # connector": the earlier defaults, 96 blocks, made requests queue for blocks and TTFT measure that queue).
    p.add_argument("--system", type=int, default=1024)
    p.add_argument("--first-input", type=int, default=1024)
    p.add_argument("--new-per-turn", type=int, default=256)
    p.add_argument("--output", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--one-shots", type=int, default=0, help="one-turn chats beside the conversations (tier pressure)")
    p.add_argument("--retain-s", type=float, default=1200.0,
                   help="the hint of arm vllm_kvproc_hint (4x the host tier's lrfu half-life: docs/store.md)")
    p.add_argument("--vllm-blocks", type=int, default=400, help="vLLM's KV cache, in blocks of 32 tokens")
    p.add_argument("--host-mib", type=int, default=2048, help="kvproc's host tier budget")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--arms", default=",".join(ARMS), help=f"a subset of {','.join(ARMS + EXTRA_ARMS)}")
    p.add_argument("--json", dest="json_path", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="a PNG of median TTFT per turn for each arm")
    p.add_argument("--arm", default=None, help=argparse.SUPPRESS)  # internal: run one arm in this process
    p.add_argument("--model", default=None, help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str]) -> int:
    a = _parser().parse_args(argv)
    if a.arm:  # child: one arm
        res = run_arm(a.arm, Path(a.model), a, Path(a.workdir))
        Path(a.out).write_text(json.dumps(res))
        return 0
    arms = [x for x in a.arms.split(",") if x]
    bad = [x for x in arms if x not in ARMS + EXTRA_ARMS]
    if bad:
        print(f"kvproc bench vllm: unknown arm(s) {bad}; one of {ARMS + EXTRA_ARMS}", file=sys.stderr)
        return 2
    work = Path(tempfile.mkdtemp(prefix="kvproc-bench-vllm-"))
    try:
        model = build_model(work / "model", a.layers, a.hidden, kind=a.kind)
        results: dict[str, Any] = {}
        passthrough = _strip_values(argv, ("--json", "--plot", "--arms"))
        for arm in arms:
            out = work / f"{arm}.json"
            env = dict(os.environ, TMPDIR=str(work))
            cmd = [sys.executable, "-m", "kvproc", "bench", "vllm", *passthrough, "--arm", arm, "--model",
                   str(model), "--workdir", str(work), "--out", str(out)]
            print(f"kvproc bench vllm: arm {arm} ...", file=sys.stderr, flush=True)
            proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            if proc.returncode != 0:
                print(proc.stderr[-4000:], file=sys.stderr)
                print(f"kvproc bench vllm: arm {arm} failed (exit {proc.returncode})", file=sys.stderr)
                return 1
            results[arm] = json.loads(out.read_text())
        outs = {arm: r.pop("outputs") for arm, r in results.items()}
        identical = all(o == next(iter(outs.values())) for o in outs.values())
        # arms whose every turn's tokens agree, grouped (a model whose kernels round a prefill over a cached prefix
        # differently gives the kvproc arms one group and vLLM alone another: hits at other depths)
        groups: list[list[str]] = []
        for arm, o in outs.items():
            for g in groups:
                if outs[g[0]] == o:
                    g.append(arm)
                    break
            else:
                groups.append([arm])
        _print(a, results, identical, groups)
        if a.json_path:
            Path(a.json_path).write_text(json.dumps({"arms": results, "outputs_identical": identical,
                                                     "output_groups": groups, "workload": _workload(a)}, indent=2))
        if a.plot:
            _plot(results, a.plot)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _strip_values(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    out, skip = [], False
    for x in argv:
        if skip:
            skip = False
            continue
        if x in flags:
            skip = True
            continue
        if x.startswith(tuple(f + "=" for f in flags)):
            continue
        out.append(x)
    return out


def _workload(a: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(a, k) for k in ("kind", "layers", "hidden", "conversations", "turns", "system", "first_input",
                                       "new_per_turn", "output", "concurrency", "vllm_blocks", "host_mib",
                                       "one_shots", "retain_s")}


def _print(a: argparse.Namespace, results: dict[str, Any], identical: bool, groups: list[list[str]]) -> None:
    print(f"kvproc bench vllm: {_workload(a)}")
    head = (f"{'arm':<16} {'TTFT p50':>9} {'TTFT p99':>9} {'out tok/s':>9} {'prompt':>8} {'vLLM $':>8} "
            f"{'connector':>9} {'computed':>8} {'conn/step':>9}")
    print(head)
    print("-" * len(head))
    for arm, r in results.items():
        share = f"{100 * r['connector_share_of_step']:.1f}%" if "connector_share_of_step" in r else "-"
        print(f"{arm:<16} {r['ttft_p50_ms']:>7.0f}ms {r['ttft_p99_ms']:>7.0f}ms {r['output_tok_s']:>9.1f} "
              f"{r['prompt_tokens']:>8} {r['from_vllm_cache']:>8} {r['from_connector']:>9} {r['computed']:>8} "
              f"{share:>9}")
    base = results.get("vllm")
    if base:  # the targets are ratios against vLLM alone, same run
        for arm, r in results.items():
            if arm != "vllm" and base["ttft_p50_ms"] and base["output_tok_s"]:
                mover = f", mover thread {r['mover_busy_s']:.2f} s" if "mover_busy_s" in r else ""
                print(f"{arm}: TTFT p50 {r['ttft_p50_ms'] / base['ttft_p50_ms']:.2f}x, p99 "
                      f"{r['ttft_p99_ms'] / base['ttft_p99_ms']:.2f}x, out tok/s "
                      f"{r['output_tok_s'] / base['output_tok_s']:.2f}x of vllm{mover}")
    if a.one_shots:
        print("TTFT p50 of the conversations' later turns: " + ", ".join(
            f"{arm} {r['ttft_later_turns_p50_ms']:.0f} ms" for arm, r in results.items()))
    print(f"\noutputs identical across arms: {identical}" + ("" if identical else f" (arms that agree: {groups})"))


def _plot(results: dict[str, Any], path: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("kvproc bench vllm: --plot needs matplotlib (pip install -e '.[plot]'); no plot written",
              file=sys.stderr)
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for arm, r in results.items():
        turns = sorted(int(t) for t in r["ttft_ms_by_turn"])
        ax.plot(turns, [r["ttft_ms_by_turn"][str(t)] if str(t) in r["ttft_ms_by_turn"] else
                        r["ttft_ms_by_turn"][t] for t in turns], marker="o", label=arm)
    ax.set_xticks(sorted({int(t) for r in results.values() for t in r["ttft_ms_by_turn"]}))
    ax.set_xlabel("turn")
    ax.set_ylabel("median TTFT (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
