"""`/v1/chat/completions` through the P/D split (pure functions of the JSON bodies; `proxy.py` does the HTTP).

The consumer must see the prompt exactly as the producer tokenised it (its page keys are the producer's), so the
chat template is rendered once, by the producer: it answers the client's chat request with `max_tokens=1` and
`return_token_ids` (vLLM then returns `prompt_token_ids`, the rendered prompt's ids, and the anchor's id). The
consumer gets a `/v1/completions` request whose prompt is those ids plus the anchor, with the envelope, and its
answer is turned back into a chat completion: the anchor's text first, the consumer's after it.

What the split cannot honour is refused with a 400 naming the field (never silently dropped): `n` > 1, `logprobs` /
`top_logprobs` / `prompt_logprobs`, `echo`, `tools` (unless `tool_choice` is "none": parsing tool calls needs the
server's parser over the whole output), messages with non-text content (images, audio: the consumer would need
their features, not only token ids), and `proxy_common.split_refusals` (penalties, guided decoding). Not handled:
a server with a reasoning parser (the reasoning is not split out of `content`).
"""

from __future__ import annotations

from typing import Any

from kvproc.integrations.vllm.proxy_common import (
    ProxyError,
    check_fields,
    consumer_params,
    merged_usage,
    refuse,
    split_refusals,
)

# Fields only a chat request has: not sent to the consumer's /v1/completions (the rendered prompt replaces them).
CHAT_ONLY = ("messages", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message",
             "documents", "tools", "tool_choice", "parallel_tool_calls", "reasoning_effort", "include_reasoning",
             "thinking_token_budget", "return_prompt_text", "media_io_kwargs", "mm_processor_kwargs",
             "add_special_tokens", "max_completion_tokens", "logprobs", "top_logprobs", "mm_payload",
             "return_mm_kwargs", "response_format")


def check_chat_request(body: Any) -> int | None:
    """Refuses what the split cannot honour; returns the client's token budget (None: up to the context's end)."""
    if not isinstance(body, dict):
        raise ProxyError(400, "the request body is not a JSON object", "invalid_request_error")
    check_fields(body)
    bad = [k for k in ("logprobs", "top_logprobs", "prompt_logprobs", "echo") if body.get(k) not in (None, False, 0)]
    if body.get("tools") and body.get("tool_choice") != "none":
        bad.append("tools (tool calls need the server's parser over the whole output; tool_choice 'none' is fine)")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        bad.append("messages (a non-empty list)")
    else:
        for i, msg in enumerate(msgs):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
                raise ProxyError(400, f"kvproc proxy: messages[{i}] must be an object with a string role, got "
                                 f"{msg!r}", "invalid_request_error")
            content = msg.get("content")
            if content is not None and not isinstance(content, (str, list)):
                raise ProxyError(400, f"kvproc proxy: messages[{i}].content must be a string or a list of parts, got "
                                 f"{content!r}", "invalid_request_error")
            if isinstance(content, list) and any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                bad.append(f"messages[{i}].content (non-text parts)")
    bad += split_refusals(body)
    try:
        if int(body.get("n") or 1) != 1:
            bad.append("n > 1")
        raw = body.get("max_completion_tokens", body.get("max_tokens"))
        budget = None if raw is None else int(raw)
    except (TypeError, ValueError) as e:
        raise ProxyError(400, f"kvproc proxy: n and max_tokens must be integers: {e}", "invalid_request_error") from e
    refuse(bad)
    return budget


def chat_prefill_body(body: dict[str, Any], prefill_params: dict[str, Any]) -> dict[str, Any]:
    out = dict(body, max_tokens=1, stream=False, return_token_ids=True, kv_transfer_params=prefill_params)
    for k in ("stream_options", "max_completion_tokens"):
        out.pop(k, None)
    if "min_tokens" in out:
        out["min_tokens"] = min(int(out["min_tokens"] or 0), 1)
    return out


def anchor_of(prefill: dict[str, Any]) -> tuple[list[int], list[int], str]:
    """(the rendered prompt's ids, [the anchor's id], the anchor's text) of the producer's chat answer."""
    choice = prefill["choices"][0]
    prompt = list(prefill.get("prompt_token_ids") or [])
    anchor = list(choice.get("token_ids") or [])
    if not prompt or len(anchor) != 1:
        raise ProxyError(502, "producer's chat answer lacks prompt_token_ids/token_ids (is it vLLM >= 0.11?)",
                         "producer_error")
    return prompt, anchor, (choice.get("message") or {}).get("content") or ""


def chat_decode_body(body: dict[str, Any], prefill: dict[str, Any], envelope: dict[str, Any] | None,
                     budget: int | None) -> dict[str, Any]:
    """The consumer's /v1/completions request: the rendered prompt's ids and the anchor, the client's sampling."""
    prompt, anchor, _ = anchor_of(prefill)
    out = {k: v for k, v in body.items() if k not in CHAT_ONLY}
    out.update(prompt=prompt + anchor, max_tokens=None if budget is None else budget - 1, return_token_ids=True)
    params = consumer_params(body, envelope)
    if params:
        out["kv_transfer_params"] = params
    else:
        out.pop("kv_transfer_params", None)
    if "min_tokens" in out:
        out["min_tokens"] = max(0, int(out["min_tokens"] or 0) - 1)
    return out


def merge_chat(body: dict[str, Any], prefill: dict[str, Any], decode: dict[str, Any] | None) -> dict[str, Any]:
    """One chat.completion: the producer's answer (id, model, message shape) with the consumer's text appended."""
    out = dict(prefill, kv_transfer_params=None)
    ch = dict(prefill["choices"][0])
    msg = dict(ch.get("message") or {"role": "assistant"})
    if decode is not None:
        d = decode["choices"][0]
        msg["content"] = (msg.get("content") or "") + (d.get("text") or "")
        ch["token_ids"] = list(ch.get("token_ids") or []) + list(d.get("token_ids") or [])
        ch["finish_reason"], ch["stop_reason"] = d.get("finish_reason"), d.get("stop_reason")
        out["usage"] = merged_usage(prefill.get("usage"), decode.get("usage"))
    ch["message"] = msg
    if not body.get("return_token_ids"):
        ch.pop("token_ids", None)
        out.pop("prompt_token_ids", None)
    out["choices"] = [ch]
    return out


def _chunk(prefill: dict[str, Any], choices: list[dict[str, Any]]) -> dict[str, Any]:
    return {"id": prefill.get("id"), "object": "chat.completion.chunk", "created": prefill.get("created"),
            "model": prefill.get("model"), "choices": choices}


def first_chunk(body: dict[str, Any], prefill: dict[str, Any], done: bool) -> dict[str, Any]:
    """The stream's first event: the role and the anchor's text (its finish reason too when it is the whole answer)."""
    prompt, anchor, text = anchor_of(prefill)
    p = prefill["choices"][0]
    ch: dict[str, Any] = {"index": 0, "delta": {"role": "assistant", "content": text}, "logprobs": None,
                          "finish_reason": p.get("finish_reason") if done else None}
    out = _chunk(prefill, [ch])
    if body.get("return_token_ids"):
        ch["token_ids"] = anchor
        out["prompt_token_ids"] = prompt
    return out


def chat_chunk(body: dict[str, Any], prefill: dict[str, Any], ev: dict[str, Any]) -> dict[str, Any]:
    """A consumer /v1/completions chunk as a chat.completion.chunk of the producer's id; usage of one engine."""
    choices = []
    for c in ev.get("choices") or []:
        ch: dict[str, Any] = {"index": 0, "delta": {"content": c.get("text") or ""}, "logprobs": None,
                              "finish_reason": c.get("finish_reason")}
        if c.get("stop_reason") is not None:
            ch["stop_reason"] = c["stop_reason"]
        if body.get("return_token_ids"):
            ch["token_ids"] = list(c.get("token_ids") or [])
        choices.append(ch)
    out = _chunk(prefill, choices)
    if ev.get("usage"):
        out["usage"] = merged_usage(prefill.get("usage"), ev["usage"])
    return out


def usage_chunk(prefill: dict[str, Any]) -> dict[str, Any]:
    return dict(_chunk(prefill, []), usage=prefill.get("usage"))
