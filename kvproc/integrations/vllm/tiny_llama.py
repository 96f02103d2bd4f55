"""A tiny random Llama checkpoint for the vLLM tests and `kvproc bench vllm` (no weights can be downloaded here).

Head size 32 (one of the sizes vLLM's CPU attention accepts), two KV heads, float32, fixed seed: the same weights on
every run, so greedy outputs are deterministic. The init range is wider than a trained model's so that attention
matters to the output (a corrupted KV page must change the tokens, or the control test proves nothing).
"""

from __future__ import annotations

from pathlib import Path

VOCAB = 512


def build_tiny_llama(out: Path, *, layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                     seed: int = 1234, max_positions: int = 4096, vocab: int = VOCAB,
                     dtype: str | None = "float32") -> Path:
    """Save the checkpoint into `out`; `dtype` is the config's torch_dtype (None: unset, vLLM then picks)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    extra = {} if dtype is None else {"torch_dtype": dtype}
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, **extra)
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return out
