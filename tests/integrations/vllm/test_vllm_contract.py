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


def _swa(window: int = 64, block: int = 32) -> object:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return SlidingWindowSpec(block_size=block, num_kv_heads=2, head_size=32, dtype=torch.float32,
                             sliding_window=window)


def _mla(block: int = 32) -> object:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec

    return MLAAttentionSpec(block_size=block, num_kv_heads=1, head_size=576, dtype=torch.float32)


def test_full_attention_becomes_one_paged_group_with_an_arena_per_layer() -> None:
    c = contract_from_vllm(_config(_full()), model_id="org/m@1")
    assert c.spec.page_tokens == 32 and c.spec.model_id == "org/m@1"
    assert [(g.name, g.kind) for g in c.spec.groups] == [("full0", GroupKind.PAGED)]
    assert c.layer_names == ("model.layers.00.attn", "model.layers.01.attn")
    assert c.groups[0].bytes_per_block == 2 * 32 * (32 + 32) * 4  # kv heads x block x (K + V head size) x fp32
    assert c.vllm_num_blocks == 24 and not c.has_sliding


def test_sliding_window_and_full_attention_are_two_aligned_paged_groups() -> None:
    """Gemma-style: vLLM's sliding-window group and its full-attention group, each its own block table in vLLM,
    one page (and one kvproc block id) in kvproc."""
    c = contract_from_vllm(_config(_swa(), _full()), model_id="m")
    assert [(g.name, g.kind) for g in c.spec.groups] == [("swa0", GroupKind.PAGED), ("full1", GroupKind.PAGED)]
    assert [g.sliding_window for g in c.groups] == [64, None] and c.has_sliding
    assert c.group_of("model.layers.11.attn").name == "full1"
    assert [g.index for g in c.groups] == [0, 1]


def test_mla_is_a_paged_group_of_its_latent_page() -> None:
    c = contract_from_vllm(_config(_mla()), model_id="m")
    assert [(g.name, g.vllm_spec) for g in c.groups] == [("mla0", "MLAAttentionSpec")]
    assert c.groups[0].bytes_per_block == 32 * 576 * 4  # one latent "head" of 576 per token, fp32


def _mamba(mode: str = "align", padded: int | None = 4096) -> object:
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=32, shapes=((4, 8), (2, 8, 8)), dtypes=(torch.float32, torch.float32),
                     mamba_cache_mode=mode, page_size_padded=padded)


def test_mamba_state_in_align_mode_is_a_bounded_group_of_its_real_bytes() -> None:
    """Qwen3-Next / LFM2 style: state groups beside full attention; the state's page is padded to the attention
    page in vLLM, and kvproc stores only the state's bytes (conv 4x8 + ssm 2x8x8 float32)."""
    c = contract_from_vllm(_config(_mamba(), _full()), model_id="m")
    assert [(g.name, g.kind) for g in c.spec.groups] == [("mamba0", GroupKind.BOUNDED), ("full1", GroupKind.PAGED)]
    state = c.groups[0]
    assert state.state and state.bytes_per_block == (4 * 8 + 2 * 8 * 8) * 4 and state.stride == 4096
    assert [g.name for g in c.states] == ["mamba0"] and [g.name for g in c.paged] == ["full1"]


@pytest.mark.parametrize("make, named", [
    (lambda: _mamba(mode="none"), "mamba_cache_mode 'align'"),
    (lambda: _mamba(), "an attention group beside state groups"),
    (lambda: _full(non_causal=True), "non_causal"),
])
def test_other_specs_are_refused_naming_the_spec(make: object, named: str) -> None:
    with pytest.raises(KvContractError, match=named):
        contract_from_vllm(_config(make()), model_id="m")  # type: ignore[operator]


def test_groups_of_other_block_sizes_are_refused_naming_them() -> None:
    with pytest.raises(KvContractError, match="block sizes .*'swa0': 16, 'full1': 32"):
        contract_from_vllm(_config(_swa(block=16), _full()), model_id="m")


def test_an_mla_only_model_is_replicated_and_mla_beside_other_groups_is_not() -> None:
    """An MLA latent is the same on every TP rank: stored once when every group is MLA; a page is one unit, so MLA
    beside a per-rank group is stored per rank with it (a mixed spec would be refused by a multi-rank store)."""
    from kvproc import Sharding

    assert contract_from_vllm(_config(_mla()), model_id="m").spec.replicated
    mixed = contract_from_vllm(_config(_mla(), _full()), model_id="m").spec
    assert not mixed.replicated and {g.sharding for g in mixed.groups} == {Sharding.PER_RANK}
    assert not contract_from_vllm(_config(_full()), model_id="m").spec.replicated


def test_describe_groups_maps_each_group_or_says_why_not_without_raising() -> None:
    """`kvproc check --vllm`'s rows: every group on its own, a refused one with contract_from_vllm's reason."""
    from kvproc.integrations.vllm.contract import describe_groups

    rows = describe_groups(_config(_swa(window=64), _mamba(mode="none"), _full(non_causal=True), _full()))
    assert [(r.index, r.vllm_spec, r.group) for r in rows] == [
        (0, "SlidingWindowSpec", "swa0"), (1, "MambaSpec", ""), (2, "FullAttentionSpec", ""),
        (3, "FullAttentionSpec", "full3")]
    assert "64 tokens" in rows[0].cached and not rows[0].refused
    assert "mamba_cache_mode 'align'" in rows[1].refused and "non_causal" in rows[2].refused
    assert rows[3].cached and rows[3].layers == 2 and rows[3].block_tokens == 32


def test_a_block_size_not_a_power_of_two_is_refused_with_one_that_is() -> None:
    with pytest.raises(KvContractError, match="block_size=384: .*block_size=512"):
        contract_from_vllm(_config(_swa(block=384)), model_id="m")
