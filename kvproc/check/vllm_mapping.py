"""`kvproc check --vllm MODEL_DIR`: how kvproc's vLLM connector maps a model's KV cache groups, without serving.

vLLM decides a model's KV cache groups (their specs, block sizes, the hybrid grouping) only once its model runner has
built the model, so this starts vLLM in this process with random weights (`load_format="dummy"`: MODEL_DIR needs its
`config.json`, not its weights; the weights' memory is still allocated) and a small KV cache, reads the KV cache
config its scheduler got, and prints, per vLLM group, the kvproc group it becomes and what a hit restores, or why it
is refused; then whether the groups make one contract together (`contract_from_vllm`). Nothing is served, no kvproc
process starts. Run it where vLLM is installed (`.venv-vllm/bin/python -m kvproc check --vllm MODEL_DIR`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from kvproc.contract import KvContractError


@dataclass
class VllmMapping:
    model_dir: str
    engine: dict[str, Any]  # what vLLM ran with (dtype, block size, ...)
    rows: list[Any]  # contract.GroupMapping, one per vLLM group
    contract: str  # the whole contract's summary, or "" when refused
    refused: str  # contract_from_vllm's error, or ""

    @property
    def ok(self) -> bool:
        return not self.refused

    def text(self) -> str:
        head = ("vLLM group", "spec", "layers", "block", "kvproc group", "what a hit restores / why refused")
        cells = [head] + [(str(r.index), r.vllm_spec, str(r.layers), str(r.block_tokens), r.group or "-",
                           r.cached or f"REFUSED: {r.refused}") for r in self.rows]
        widths = [max(len(c[i]) for c in cells) for i in range(5)]
        settings = ", ".join(f"{k} {v}" for k, v in self.engine.items())
        lines = [f"kvproc check --vllm {self.model_dir} ({settings})", ""]
        lines += ["  ".join(c[i].ljust(widths[i]) for i in range(5)) + "  " + c[5] for c in cells]
        lines.append("")
        lines.append(f"contract: {self.contract}" if self.ok else f"contract: REFUSED: {self.refused}")
        return "\n".join(lines)


def _scheduler_kv_cache_config(model_dir: str, dtype: str, block_size: int | None, max_model_len: int,
                               trust_remote_code: bool) -> tuple[Any, Any]:
    """Start vLLM in this process on random weights; its (VllmConfig, scheduler's KVCacheConfig)."""
    # In-process engine core (its scheduler readable here), a KV cache of 1 GiB at most: set before vLLM is imported.
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the mapping is the output, not vLLM's start-up log
    from vllm import LLM

    kw: dict[str, Any] = dict(model=model_dir, load_format="dummy", skip_tokenizer_init=True, dtype=dtype,
                              enforce_eager=True, max_model_len=max_model_len, max_num_seqs=1,
                              enable_prefix_caching=True, trust_remote_code=trust_remote_code)
    if block_size:
        kw["block_size"] = block_size
    llm = LLM(**kw)
    try:
        core = llm.llm_engine.engine_core.engine_core  # the in-process client's EngineCore
        return llm.llm_engine.vllm_config, core.scheduler.kv_cache_config
    finally:
        llm.llm_engine.engine_core.shutdown()


def vllm_mapping(model_dir: str, *, dtype: str = "auto", block_size: int | None = None, max_model_len: int = 1024,
                 trust_remote_code: bool = False) -> VllmMapping:
    from kvproc.integrations.vllm.contract import contract_from_vllm, describe_groups, model_identity

    vllm_config, kv_cache_config = _scheduler_kv_cache_config(model_dir, dtype, block_size, max_model_len,
                                                              trust_remote_code)
    mc = vllm_config.model_config
    engine = {"vLLM dtype": str(mc.dtype).removeprefix("torch."),
              "block size": vllm_config.cache_config.block_size, "max_model_len": max_model_len}
    rows = describe_groups(kv_cache_config)
    try:
        c = contract_from_vllm(kv_cache_config, model_id=model_identity(vllm_config))
    except KvContractError as e:
        return VllmMapping(model_dir, engine, rows, "", str(e))
    states = len(c.states)
    sharding = "stored once for all ranks (REPLICATED)" if c.spec.replicated else "each rank its own shard"
    summary = (f"ok: pages of {c.block_tokens} tokens; {len(c.groups)} group(s) ({len(c.groups) - states} paged, "
               f"{states} state); under tensor parallel {sharding}")
    return VllmMapping(model_dir, engine, rows, summary, "")
