"""vLLM v1's `KVCacheManager` replaying a trace: the baseline of `kvproc bench replay --vs-vllm`.

Runs in `.venv-vllm` (the parent starts it there and reads one JSON line). The same work per request as kvproc's
replay: hash the prompt (vLLM's request block hasher, chained per 16-token page), probe (`get_computed_blocks`),
allocate and cache the rest (`allocate_slots`), free. Unbounded cache (more blocks than the trace has pages), one
request at a time, prompt synthesis (the same `synth_tokens`) excluded from the time.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    trace_path, limit, hash_name = Path(argv[0]), int(argv[1]), argv[2]
    os.environ.setdefault("PYTHONHASHSEED", "0")
    import logging

    logging.disable(logging.WARNING)
    import torch
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.request import Request

    from kvproc.bench.replay import load_trace, synth_tokens

    page = 16
    trace = load_trace(trace_path, limit or None)
    total_pages = sum(len(r.hash_ids) for r in trace) * (512 // page)
    longest = max(len(r.hash_ids) for r in trace) * 512
    spec = FullAttentionSpec(block_size=page, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=total_pages + 2, kv_cache_tensors=[],
                           kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    manager = KVCacheManager(config, max_model_len=longest + page, scheduler_block_size=page, hash_block_size=page,
                             enable_caching=True)
    hash_fn = get_hash_fn_by_name(hash_name)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(page, hash_fn)
    params = SamplingParams(max_tokens=1)
    hit_tokens = input_tokens = 0
    synth_s = synth_cpu = 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    for i, r in enumerate(trace):
        ts, cs = time.perf_counter(), time.process_time()
        tokens = synth_tokens(r.hash_ids).tolist()
        synth_s += time.perf_counter() - ts
        synth_cpu += time.process_time() - cs
        req = Request(f"r{i}", tokens, params, None, block_hasher=hasher)
        blocks, computed, *_ = manager.get_computed_blocks(req)
        got = manager.allocate_slots(req, len(tokens) - computed, computed, blocks)
        if got is None:
            raise RuntimeError(f"vLLM refused request {i}")
        manager.free(req)
        hit_tokens += min(computed, r.input_length)
        input_tokens += r.input_length
    dt = time.perf_counter() - t0 - synth_s
    dt_cpu = time.process_time() - c0 - synth_cpu  # CPU time: steadier than wall time on a shared machine
    print(json.dumps({"requests": len(trace), "seconds": dt, "requests_per_s": len(trace) / dt,
                      "cpu_requests_per_s": len(trace) / dt_cpu,
                      "token_hit_ratio": hit_tokens / max(input_tokens, 1), "hash": hash_name}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
