"""vLLM's KV cache spec -> kvproc's KV contract: the one place that knows how vLLM lays out KV.

`contract_from_vllm(kv_cache_config, ...)` is the whole mapping. Each vLLM KV cache group becomes a kvproc group,
each of its layers one arena (vLLM names the layers; kvproc names arenas after them). Supported today:

| vLLM spec | kvproc group | stored block |
|---|---|---|
| `FullAttentionSpec` (exactly: no subclass), causal, no KV quantisation, no padded pages | `PAGED` "attn" | one vLLM block of one layer, its `page_size_bytes` as is (on CPU: `[num_kv_heads, block_size, 2*head_size]`, K and V side by side) |

Anything else (sliding window, chunked local, MLA, Mamba/linear state, cross attention, several groups, quantised KV)
is refused with a `KvContractError` naming the spec, never served with the wrong bytes. The next attention type is an
entry in `_SUPPORTED` plus, for a bounded state, a `GroupKind.BOUNDED` group: not connector code.

This module imports no vLLM at import time: it reads the config's fields by name, so it is testable on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvproc import GroupKind, GroupSpec, KvContractError, KvSpec

# vLLM spec class name -> the kvproc group it becomes. Exact class names: a subclass of FullAttentionSpec (MLA,
# sliding-window MLA, sink attention, ...) has another layout and must not pass as full attention.
_SUPPORTED: dict[str, tuple[str, GroupKind]] = {
    "FullAttentionSpec": ("attn", GroupKind.PAGED),
}


@dataclass(frozen=True)
class VllmKvContract:
    """A vLLM engine's KV as kvproc sees it: the spec plus the geometry of every layer's block."""

    spec: KvSpec
    group: str  # the one paged group
    layer_names: tuple[str, ...]  # vLLM's layer names, in vLLM's order; one arena each
    bytes_per_block: int  # one layer's block (vLLM's page_size_bytes)
    block_tokens: int  # vLLM's block size = kvproc's page size
    vllm_num_blocks: int  # blocks of vLLM's own cache (its tensors' first dimension)


def contract_from_vllm(kv_cache_config: Any, *, model_id: str) -> VllmKvContract:
    """Map vLLM's `KVCacheConfig` to a kvproc contract, or raise `KvContractError` naming what is unsupported.

    `model_id` is the identity of the weights (kvproc keys every page with it, so engines with other weights never
    share KV)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) != 1:
        names = [type(g.kv_cache_spec).__name__ for g in groups]
        raise KvContractError(f"kvproc's vLLM connector supports one KV cache group (full attention), this model has "
                              f"{len(groups)}: {names}")
    spec = groups[0].kv_cache_spec
    kind_name = type(spec).__name__
    if kind_name not in _SUPPORTED:
        raise KvContractError(f"kvproc's vLLM connector does not support the KV cache spec {kind_name} yet "
                              f"(supported: {sorted(_SUPPORTED)}): {spec!r}")
    quant = getattr(spec, "kv_quant_mode", None)
    if quant is not None and int(quant) != 0:
        raise KvContractError(f"kvproc's vLLM connector does not support quantised KV ({kind_name} with "
                              f"kv_quant_mode={quant!r})")
    if getattr(spec, "non_causal", False):
        # A non-causal (prefix-LM) layer's KV of a prefix depends on the tokens after it: not a reusable prefix.
        raise KvContractError(f"kvproc's vLLM connector does not support non-causal attention ({kind_name} with "
                              "non_causal=True): a prefix's KV there depends on the tokens after it")
    if getattr(spec, "page_size_padded", None):
        raise KvContractError(f"kvproc's vLLM connector does not support padded pages ({kind_name} with "
                              f"page_size_padded={spec.page_size_padded})")
    group, kind = _SUPPORTED[kind_name]
    block = int(spec.block_size)
    if block <= 0 or block & (block - 1):
        raise KvContractError(f"vLLM block_size={block}: kvproc pages must be a power of two tokens")
    layers = tuple(groups[0].layer_names)
    if not layers:
        raise KvContractError(f"the KV cache group {kind_name} names no layers")
    kv_spec = KvSpec(block, (GroupSpec(group, kind),), model_id=model_id)
    return VllmKvContract(spec=kv_spec, group=group, layer_names=layers, bytes_per_block=int(spec.page_size_bytes),
                          block_tokens=block, vllm_num_blocks=int(kv_cache_config.num_blocks))


def model_identity(vllm_config: Any, override: str | None = None) -> str:
    """The weights' identity for kvproc's keys: the user's `model_id` if given (recommended: a checkpoint digest),
    else vLLM's model name or path, revision, dtype and quantisation (a local path is an identity only as long as
    its files do not change)."""
    if override:
        return override
    mc = vllm_config.model_config
    return (f"vllm:{mc.model}@{getattr(mc, 'revision', None) or ''}:dtype={mc.dtype}:"
            f"quant={getattr(mc, 'quantization', None) or ''}")
