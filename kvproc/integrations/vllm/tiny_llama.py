"""A tiny random Llama checkpoint for the vLLM tests and `kvproc bench vllm` (no weights can be downloaded here).

Head size 32 (one of the sizes vLLM's CPU attention accepts), two KV heads, float32, fixed seed: the same weights on
every run, so greedy outputs are deterministic. The init range is wider than a trained model's so that attention
matters to the output (a corrupted KV page must change the tokens, or the control test proves nothing).

A tiny tokenizer comes with it (`tokenizer.json`, built with `tokenizers`), so that `vllm serve` can answer
`/v1/chat/completions`: a word-level vocabulary (`w7` ... `w511`, one token each, ids = the number) with special
tokens `<unk>` `<s>` `</s>` (0-2, the config's bos/eos) and the chat template's `<|system|>` `<|user|>`
`<|assistant|>` `<|end|>` (3-6). Engines that take token-id prompts skip it (`skip_tokenizer_init`).
"""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 512
SPECIAL = ["<unk>", "<s>", "</s>"]
CHAT_SPECIAL = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
FIRST_WORD = len(SPECIAL) + len(CHAT_SPECIAL)
# Each message: its role's marker, its text, <|end|>; then the assistant's marker when a reply is wanted.
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def words(ids: list[int]) -> str:
    """The text that the tiny tokenizer turns into exactly these word ids (each >= FIRST_WORD)."""
    assert all(FIRST_WORD <= i < VOCAB for i in ids), ids
    return " ".join(f"w{i}" for i in ids)


def build_tiny_tokenizer(out: Path, vocab: int = VOCAB) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    table = {t: i for i, t in enumerate(SPECIAL + CHAT_SPECIAL)}
    table.update({f"\u2581w{i}": i for i in range(FIRST_WORD, vocab)})  # Metaspace marks a word's leading space
    tok = Tokenizer(models.WordLevel(table, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.add_special_tokens(SPECIAL + CHAT_SPECIAL)  # matched before pre-tokenisation; skipped in decoded text
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>",
        "model_max_length": 4096, "chat_template": CHAT_TEMPLATE}, indent=1))


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
    build_tiny_tokenizer(out, vocab)
    return out
