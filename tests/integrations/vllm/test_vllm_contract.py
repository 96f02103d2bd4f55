"""`contract_from_vllm`: vLLM's own KV cache spec objects -> kvproc's contract, and the specs it refuses (by name).
No engine: the spec classes are vLLM's real ones."""

from __future__ import annotations

import pytest
import torch

from kvproc import GroupKind, KvContractError
from kvproc.integrations.vllm.contract import contract_from_vllm


def _config(*specs: object, layers: int = 2) -> object:
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec

    groups = [KVCacheGroupSpec([f"model.layers.{g}{i}.attn" for i in range(layers)], s) for g, s in enumerate(specs)]
    return KVCacheConfig(num_blocks=24, kv_cache_tensors=[], kv_cache_groups=groups)


def _full(**kw: object) -> object:
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, **kw)


def test_full_attention_becomes_one_paged_group_with_an_arena_per_layer() -> None:
    c = contract_from_vllm(_config(_full()), model_id="org/m@1")
    assert c.spec.page_tokens == 32 and c.spec.model_id == "org/m@1"
    assert [(g.name, g.kind) for g in c.spec.groups] == [("attn", GroupKind.PAGED)]
    assert c.layer_names == ("model.layers.00.attn", "model.layers.01.attn")
    assert c.bytes_per_block == 2 * 32 * (32 + 32) * 4  # kv heads x block x (K + V head size) x fp32
    assert c.vllm_num_blocks == 24


@pytest.mark.parametrize("make, named", [
    (lambda: __import__("vllm.v1.kv_cache_interface", fromlist=["x"]).SlidingWindowSpec(
        block_size=32, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=64), "SlidingWindowSpec"),
    (lambda: __import__("vllm.v1.kv_cache_interface", fromlist=["x"]).MLAAttentionSpec(
        block_size=32, num_kv_heads=1, head_size=576, dtype=torch.float32), "MLAAttentionSpec"),
    (lambda: _full(non_causal=True), "non_causal"),
])
def test_other_specs_are_refused_naming_the_spec(make: object, named: str) -> None:
    with pytest.raises(KvContractError, match=named):
        contract_from_vllm(_config(make()), model_id="m")  # type: ignore[operator]


def test_several_groups_are_refused_naming_them() -> None:
    with pytest.raises(KvContractError, match="2: \\['FullAttentionSpec', 'FullAttentionSpec'\\]"):
        contract_from_vllm(_config(_full(), _full()), model_id="m")
