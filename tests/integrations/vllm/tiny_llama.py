"""A tiny random Llama checkpoint for the vLLM tests (no weights can be downloaded on the test machines).

Head size 32 (one of the sizes vLLM's CPU attention accepts), two KV heads, float32, fixed seed: the same weights on
every run, so greedy outputs are deterministic. The init range is wider than a trained model's so that attention
matters to the output (a corrupted KV page must change the tokens, or the control test proves nothing).
"""

from __future__ import annotations

from pathlib import Path

VOCAB = 512


def build_tiny_llama(out: Path, *, layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                     seed: int = 1234, max_positions: int = 4096) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      initializer_range=0.2, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                      torch_dtype="float32")
    model = LlamaForCausalLM(cfg).to(torch.float32).eval()
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    return out
