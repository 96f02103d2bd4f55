"""vLLM's KV cache spec -> kvproc's KV contract: the one place that knows how vLLM lays out KV.

`contract_from_vllm(kv_cache_config, ...)` is the whole mapping. Each vLLM KV cache group becomes a kvproc group,
each of its layers one arena (vLLM names the layers; kvproc names arenas after them). One block of one layer is
`page_size_bytes` contiguous bytes in vLLM 0.32 for every kind below (`kv_caches[layer][block]`), so the stored
block is vLLM's block as is.

- `FullAttentionSpec` (causal, unquantised, unpadded) -> `PAGED` "full<i>": a hit restores every page of the prefix.
- `MLAAttentionSpec` (one latent "head" of `kv_lora_rank + rope` per token) -> `PAGED` "mla<i>": every page.
- `SlidingWindowSpec` -> `PAGED` "swa<i>": every page is saved (a page's KV depends only on the tokens before it);
  a hit restores the pages vLLM allocated for the window before it. vLLM gives its null block (id 0) for the pages
  out of the window, and those are not written.
- `MambaSpec` in vLLM's "align" mode (recurrent / GDN / conv state; what vLLM runs with prefix caching on) ->
  `BOUNDED` "mamba<i>": one state per page boundary, a kvproc checkpoint. vLLM's block i of the group holds the state
  after (i + 1) pages; it hands the connector each state it commits (`boundary_state_offloads`), which becomes the
  checkpoint at that page, and a hit at boundary C restores the checkpoint into the group's block at index C/page - 1,
  the one vLLM reads the state from. Stored: the state's real bytes (conv + recurrent), not vLLM's page padding.

All paged groups share kvproc's page (vLLM's block size must be the same in every group: a model whose groups have
other block sizes is refused, naming them) and one block id in kvproc's pool; each keeps its own vLLM block table.
Anything else (Mamba state outside "align" mode, chunked local, cross attention, quantised or padded KV, a subclass
of these specs) is refused with a `KvContractError` naming the spec and the reason, never served as full attention.
`describe_groups` says the same per group, without raising (`kvproc check --vllm`).

This module imports no vLLM at import time: it reads the config's fields by name, so it is testable on its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvproc import GroupKind, GroupSpec, KvContractError, KvSpec, Sharding

# vLLM spec class name -> (kvproc group name prefix, kind). Exact class names: a subclass of FullAttentionSpec
# (sliding-window MLA, sink attention, ...) has another layout or another notion of a prefix and must not pass.
_SUPPORTED: dict[str, tuple[str, GroupKind]] = {
    "FullAttentionSpec": ("full", GroupKind.PAGED),
    "MLAAttentionSpec": ("mla", GroupKind.PAGED),
    "SlidingWindowSpec": ("swa", GroupKind.PAGED),
    "MambaSpec": ("mamba", GroupKind.BOUNDED),
}
# Refused with the reason an integrator needs (the rest: "not supported yet").
_WHY_NOT: dict[str, str] = {
    "ChunkedLocalAttentionSpec": "its attention restarts every chunk; not mapped yet",
    "CrossAttentionSpec": "encoder KV is not a prefix of the prompt",
    "EncoderOnlyAttentionSpec": "encoder-only layers keep no KV cache to reuse",
}


@dataclass(frozen=True)
class VllmGroup:
    """One of vLLM's KV cache groups as kvproc sees it."""

    name: str  # the kvproc group ("full0", "swa1", "mla0", ...)
    vllm_spec: str  # vLLM's spec class name
    index: int  # its position in vLLM's `kv_cache_groups` (= in every per-group block-id tuple vLLM hands over)
    layer_names: tuple[str, ...]  # vLLM's layer names, in vLLM's order; one arena each
    bytes_per_block: int  # one layer's block as kvproc stores it (vLLM's page_size_bytes; a state: its real bytes)
    sliding_window: int | None = None  # tokens, for a sliding-window group
    # Bytes from one of vLLM's blocks to the next in the layer's tensor: a state group's page is padded to the
    # attention page (vLLM's hybrid allocator makes every group's pages one size), the padding never read nor stored.
    block_stride: int = 0  # 0: bytes_per_block

    @property
    def stride(self) -> int:
        return self.block_stride or self.bytes_per_block

    @property
    def sliding(self) -> bool:
        return self.sliding_window is not None

    @property
    def state(self) -> bool:
        """A state group (vLLM's MambaSpec): one state per page boundary, a kvproc checkpoint, not pages."""
        return self.vllm_spec == "MambaSpec"


@dataclass(frozen=True)
class VllmKvContract:
    """A vLLM engine's KV as kvproc sees it: the spec plus the geometry of every group's blocks."""

    spec: KvSpec
    groups: tuple[VllmGroup, ...]  # in vLLM's group order
    block_tokens: int  # vLLM's block size = kvproc's page size
    vllm_num_blocks: int  # blocks of vLLM's own cache (every layer tensor's first dimension)

    @property
    def layer_names(self) -> tuple[str, ...]:
        return tuple(n for g in self.groups for n in g.layer_names)

    @property
    def has_sliding(self) -> bool:
        """A sliding-window group: vLLM frees a request's out-of-window blocks at its next step, so a save must have
        read them before that step's forward."""
        return any(g.sliding for g in self.groups)

    @property
    def paged(self) -> tuple[VllmGroup, ...]:
        return tuple(g for g in self.groups if not g.state)

    @property
    def states(self) -> tuple[VllmGroup, ...]:
        return tuple(g for g in self.groups if g.state)

    def group_of(self, layer: str) -> VllmGroup:
        for g in self.groups:
            if layer in g.layer_names:
                return g
        raise KeyError(layer)


def _check_spec(spec: Any, kind_name: str) -> None:
    if kind_name == "MambaSpec":
        mode = getattr(spec, "mamba_cache_mode", "none")
        if mode != "align":
            raise KvContractError(f"kvproc's vLLM connector needs vLLM's MambaSpec in mamba_cache_mode 'align' (a "
                                  f"state kept at every block boundary; vLLM's mode with prefix caching on), got "
                                  f"{mode!r}: there is no boundary state to save or restore")
        if getattr(spec, "num_speculative_blocks", 0):
            raise KvContractError("kvproc's vLLM connector does not support speculative decoding's extra state blocks "
                                  f"(MambaSpec num_speculative_blocks={spec.num_speculative_blocks})")
        return  # its padded page is copied whole: the padding is vLLM's, never read
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


@dataclass(frozen=True)
class GroupMapping:
    """One of vLLM's KV cache groups and what kvproc does with it (`kvproc check --vllm`)."""

    index: int
    vllm_spec: str
    layers: int
    block_tokens: int
    group: str  # the kvproc group ("": refused)
    cached: str  # what a hit restores ("" when refused)
    refused: str  # why not ("" when mapped)


_CACHED = {
    "FullAttentionSpec": "every page of the prefix",
    "MLAAttentionSpec": "every page of the prefix (the latent; stored once for all TP ranks when every group is MLA)",
    "SlidingWindowSpec": "every page is saved; a hit loads the pages of the window before it ({window} tokens)",
    "MambaSpec": "the state at the hit's page boundary (a checkpoint per page boundary vLLM offers)",
}


def describe_groups(kv_cache_config: Any) -> list[GroupMapping]:
    """Every vLLM KV cache group, mapped or refused with the reason, each on its own (`contract_from_vllm` then
    checks the groups together: one page size for all, a power of two, an attention group beside state groups)."""
    out = []
    for i, vg in enumerate(getattr(kv_cache_config, "kv_cache_groups", None) or []):
        spec = vg.kv_cache_spec
        kind_name = type(spec).__name__
        row: dict[str, Any] = dict(index=i, vllm_spec=kind_name, layers=len(vg.layer_names),
                                   block_tokens=int(spec.block_size))
        try:
            if kind_name not in _SUPPORTED:
                raise KvContractError(_WHY_NOT.get(kind_name, "not supported yet"))
            _check_spec(spec, kind_name)
        except KvContractError as e:
            out.append(GroupMapping(**row, group="", cached="", refused=str(e)))
            continue
        window = getattr(spec, "sliding_window", None)
        out.append(GroupMapping(**row, group=f"{_SUPPORTED[kind_name][0]}{i}",
                                cached=_CACHED[kind_name].format(window=window), refused=""))
    return out


def contract_from_vllm(kv_cache_config: Any, *, model_id: str) -> VllmKvContract:
    """Map vLLM's `KVCacheConfig` to a kvproc contract, or raise `KvContractError` naming what is unsupported.

    `model_id` is the identity of the weights (kvproc keys every page with it, so engines with other weights never
    share KV)."""
    vgroups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if not vgroups:
        raise KvContractError("vLLM's KV cache config has no KV cache group")
    groups: list[VllmGroup] = []
    sizes: dict[str, int] = {}
    for i, vg in enumerate(vgroups):
        spec = vg.kv_cache_spec
        kind_name = type(spec).__name__
        if kind_name not in _SUPPORTED:
            why = _WHY_NOT.get(kind_name, "not supported yet")
            all_kinds = [type(g.kv_cache_spec).__name__ for g in vgroups]
            raise KvContractError(f"kvproc's vLLM connector does not support the KV cache spec {kind_name} (group {i} "
                                  f"of {all_kinds}): {why}; supported: {sorted(_SUPPORTED)}")
        _check_spec(spec, kind_name)
        prefix, kind = _SUPPORTED[kind_name]
        layers = tuple(vg.layer_names)
        if not layers:
            raise KvContractError(f"the KV cache group {i} ({kind_name}) names no layers")
        window = getattr(spec, "sliding_window", None) if kind_name == "SlidingWindowSpec" else None
        if window is not None and int(window) <= 0:
            raise KvContractError(f"group {i} ({kind_name}): sliding_window={window} is not a window")
        page = int(spec.page_size_bytes)
        real = int(getattr(spec, "real_page_size_bytes", page)) if kind is GroupKind.BOUNDED else page
        groups.append(VllmGroup(f"{prefix}{i}", kind_name, i, layers, real, None if window is None else int(window),
                                page if real != page else 0))
        sizes[f"{prefix}{i}"] = int(spec.block_size)
    if all(g.state for g in groups):
        raise KvContractError(f"kvproc's vLLM connector needs an attention group beside state groups "
                              f"({[g.vllm_spec for g in groups]}): its checkpoints are kept with pages")
    if len(set(sizes.values())) != 1:
        raise KvContractError(f"kvproc pages are one size for every group; vLLM's groups have block sizes {sizes}")
    block = next(iter(sizes.values()))
    if block <= 0 or block & (block - 1):
        hint = 1 << max(0, block - 1).bit_length()
        raise KvContractError(f"vLLM block_size={block}: kvproc pages must be a power of two tokens (start vLLM with "
                              f"block_size={hint}, a power of two vLLM accepts for this model as well)")
    # An MLA latent is the same on every tensor-parallel rank: a model of MLA groups only is stored once (rank 0's
    # save, every rank's load). Beside other groups it is stored per rank, with them (a page is one unit).
    replicated = all(g.vllm_spec == "MLAAttentionSpec" for g in groups)
    sharding = Sharding.REPLICATED if replicated else Sharding.PER_RANK
    kv_spec = KvSpec(block, tuple(GroupSpec(g.name, _SUPPORTED[g.vllm_spec][1], sharding=sharding) for g in groups),
                     model_id=model_id)
    return VllmKvContract(spec=kv_spec, groups=tuple(groups), block_tokens=block,
                          vllm_num_blocks=int(kv_cache_config.num_blocks))


def model_identity(vllm_config: Any, override: str | None = None) -> str:
    """The weights' identity for kvproc's keys: the user's `model_id` if given (recommended: a checkpoint digest),
    else vLLM's model name or path, revision, dtype and quantisation (a local path is an identity only as long as
    its files do not change)."""
    if override:
        return override
    mc = vllm_config.model_config
    return (f"vllm:{mc.model}@{getattr(mc, 'revision', None) or ''}:dtype={mc.dtype}:"
            f"quant={getattr(mc, 'quantization', None) or ''}")
